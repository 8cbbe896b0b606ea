"""Model and tokenizer loading and saving.

``load_model_and_tokenizer("embedded:tiny")`` (or ``embedded:small``) builds the embedded default;
anything else must be a local Hugging Face model directory. Runs are offline: a path that is not a
directory is an error at once (no hub look-up, no retries), whatever it looks like. Weights load
from safetensors only: a directory with only a pickled checkpoint (``pytorch_model.bin``) is
refused, since unpickling can run arbitrary code. A model's own Python code (``auto_map`` in
``config.json``) runs only with ``trust_remote_code=True``.

Every failure is one line, a ``ModelLoadError`` (a ``ValueError``, which the CLI reports).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tiny import build_char_tokenizer, build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBEDDED_PREFIX = "embedded:"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelLoadError(ValueError):
    """A model or tokenizer that cannot be loaded; the message is one line naming the path."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def prepare_tokenizer(tokenizer, padding_side: str = "right"):
    """Pad token = eos when missing; the padding side (left for generation, right for training)."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad token nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def model_directory(path: str, need_config: bool = True) -> Path:
    """The local directory of a model, or a one-line ``ModelLoadError``."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(f"model directory not found: {path} (models load from local directories only)")
    if need_config and not (p / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {path}: not a Hugging Face model directory")
    return p


def check_safe_weights(p: Path) -> None:
    """The directory must hold safetensors weights; a pickled checkpoint alone is refused."""
    if any(p.glob("*.safetensors")):
        return
    pickled = sorted(f.name for f in p.iterdir() if f.suffix in PICKLED_SUFFIXES)
    if pickled:
        name = "pytorch_model.bin" if "pytorch_model.bin" in pickled else pickled[0]
        raise ModelLoadError(
            f"pickled checkpoint refused for safety: {p} has {name} and no *.safetensors; convert it with "
            "`model.save_pretrained(dir, safe_serialization=True)` where you trust the file"
        )
    raise ModelLoadError(f"no model weights (*.safetensors) in {p}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _load_error(path: str, what: str, exc: Exception) -> ModelLoadError:
    if "trust_remote_code" in str(exc):
        return ModelLoadError(f"{path} holds its own model code (auto_map); it runs only with trust_remote_code=True")
    return ModelLoadError(f"{path}: cannot load {what} ({_first_line(exc)})")


def load_tokenizer(path: str, padding_side: str = "right", trust_remote_code: bool = False):
    if path.startswith(EMBEDDED_PREFIX):
        return prepare_tokenizer(build_char_tokenizer(), padding_side)
    from transformers import AutoTokenizer

    p = model_directory(path, need_config=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _load_error(path, "a tokenizer", exc) from None
    return prepare_tokenizer(tokenizer, padding_side)


def load_model(
    path: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
    seed: int = 0,
    tokenizer=None,
    trust_remote_code: bool = False,
):
    """A causal LM from a local directory (or ``embedded:tiny|small``), in ``dtype`` on ``device``."""
    torch_dtype = resolve_dtype(dtype)
    if path.startswith(EMBEDDED_PREFIX):
        model = build_tiny_model(path[len(EMBEDDED_PREFIX) :], tokenizer=tokenizer, seed=seed)
        model = model.to(dtype=torch_dtype)
    else:
        from transformers import AutoModelForCausalLM

        p = model_directory(path)
        check_safe_weights(p)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(p), dtype=torch_dtype, use_safetensors=True, local_files_only=True,
                trust_remote_code=trust_remote_code,
            )
        except (OSError, ValueError) as exc:
            raise _load_error(path, "a causal LM", exc) from None
    model = model.to(device)
    if gradient_checkpointing:
        # transformers 5 renamed it; 4.x has only the old name
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.config.use_cache = False
    return model


def load_model_and_tokenizer(path: str, padding_side: str = "right", trust_remote_code: bool = False, **kwargs):
    """``(model, tokenizer)``; ``kwargs`` go to ``load_model``. The model directory is checked
    first, so a wrong path gets the model's error rather than the tokenizer's."""
    if not path.startswith(EMBEDDED_PREFIX):
        check_safe_weights(model_directory(path))
    tokenizer = load_tokenizer(path, padding_side, trust_remote_code=trust_remote_code)
    return load_model(path, tokenizer=tokenizer, trust_remote_code=trust_remote_code, **kwargs), tokenizer


def save_model_and_tokenizer(model, tokenizer, out_dir: str | Path) -> Path:
    """``save_pretrained`` (safetensors) for both: the directory loads in transformers and vLLM."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
