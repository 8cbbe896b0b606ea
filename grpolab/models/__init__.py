"""Model and tokenizer loading/saving (``loading``), the embedded tiny model (``tiny``), the
chunked output head that scores tokens without the whole logits (``fused_head``), the
shared-prompt training forward (``shared_prefix``) and float32 logits under autocast (``precision``)."""

from .fused_head import (
    CHUNKED_HEAD_MODEL_TYPES,
    log_probs_from_forward,
    output_head,
    response_log_probs,
    sum_response_log_probs,
    unwrap_model,
)
from .loading import (
    DTYPES,
    EMBEDDED_PREFIX,
    ModelLoadError,
    check_safe_weights,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    model_directory,
    prepare_tokenizer,
    resolve_dtype,
    save_model_and_tokenizer,
)
from .precision import logits_fp32_enabled, set_logits_fp32
from .tiny import TINY_SIZES, build_char_tokenizer, build_tiny_model

__all__ = [
    "CHUNKED_HEAD_MODEL_TYPES", "log_probs_from_forward", "output_head", "response_log_probs",
    "sum_response_log_probs", "unwrap_model",
    "DTYPES", "EMBEDDED_PREFIX", "ModelLoadError", "TINY_SIZES", "build_char_tokenizer", "build_tiny_model",
    "check_safe_weights", "load_model", "load_model_and_tokenizer", "load_tokenizer", "logits_fp32_enabled",
    "model_directory", "prepare_tokenizer", "resolve_dtype", "save_model_and_tokenizer", "set_logits_fp32",
]
