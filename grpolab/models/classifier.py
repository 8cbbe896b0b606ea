"""Sequence classifiers for reward models: a local ``AutoModelForSequenceClassification`` directory
as it is, or a causal LM (a directory, or ``embedded:tiny|small``) with a value head — the same
backbone with a fresh linear ``score`` head that reads the hidden state of the last non-pad token
(transformers' ``*ForSequenceClassification``, so the result saves as an ordinary HF directory)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .loading import (
    EMBEDDED_PREFIX,
    ModelLoadError,
    check_safe_weights,
    first_line,
    load_model,
    load_tokenizer,
    model_directory,
    resolve_dtype,
)


def _config(path: str) -> dict:
    """The directory's ``config.json`` as a mapping ({} when there is none, or it is not one)."""
    if path.startswith(EMBEDDED_PREFIX):
        return {}
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_sequence_classifier(path: str) -> bool:
    """A directory whose ``config.json`` names a ``*ForSequenceClassification`` architecture."""
    return any(str(a).endswith("ForSequenceClassification") for a in _config(path).get("architectures") or [])


def describe_architecture(path: str) -> str:
    """What ``config.json`` says the model is, in words: ``a LlamaForCausalLM (a causal LM, no
    sequence-classification head)``, or its ``model_type`` when it names no architecture."""
    config = _config(path)
    names = [str(a) for a in config.get("architectures") or []]
    if not names:
        return f"a {config.get('model_type') or 'model'} whose config.json names no architecture"
    kind = " (a causal LM, no sequence-classification head)" if any(a.endswith("ForCausalLM") for a in names) else ""
    return f"a {', '.join(names)}{kind}"


def value_head_model(lm, num_labels: int = 1, seed: int = 0):
    """The ``*ForSequenceClassification`` of ``lm``'s architecture with ``lm``'s backbone weights
    and a new ``num_labels``-output head (initialised with ``seed``)."""
    from transformers import AutoModelForSequenceClassification

    fields = {k: v for k, v in lm.config.to_dict().items() if k not in ("id2label", "label2id")}
    config = type(lm.config).from_dict({**fields, "num_labels": num_labels, "architectures": None})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForSequenceClassification.from_config(config)
        except ValueError as exc:
            raise ModelLoadError(f"{type(lm).__name__} has no sequence-classification form in transformers "
                                 f"({first_line(exc)})") from None
    backbone = getattr(model, model.base_model_prefix)
    backbone.load_state_dict(getattr(lm, lm.base_model_prefix).state_dict())
    return model.to(dtype=next(lm.parameters()).dtype)


def _saved_classifier(path: str, dtype, trust_remote_code: bool, require_head: bool):
    """A ``*ForSequenceClassification`` directory as saved; with ``require_head`` every weight must be in its
    files (none left freshly initialised: a missing head would score at random)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForSequenceClassification

    p = model_directory(path)
    check_safe_weights(p)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            str(p), dtype=resolve_dtype(dtype), use_safetensors=True, local_files_only=True,
            trust_remote_code=trust_remote_code, output_loading_info=True)
    except (OSError, ValueError, SafetensorError) as exc:
        raise ModelLoadError(f"{path}: cannot load a sequence classifier ({first_line(exc)})") from None
    missing = sorted(info.get("missing_keys") or ())
    if require_head and missing:
        raise ModelLoadError(f"{path}: its weights lack {', '.join(missing[:3])}{' ...' * (len(missing) > 3)} "
                             "(they would be freshly initialised: the scores would be random)")
    return model


def load_sequence_classifier(path: str, dtype="float32", device="cpu", seed: int = 0, trust_remote_code: bool = False,
                             require_head: bool = False):
    """``(model, tokenizer)``: a sequence classifier as saved, or a causal LM with a value head
    (see the module doc); the model's ``pad_token_id`` is the tokenizer's (the last non-pad token
    is where the score is read). The directory is checked first (a path that is not a model gets the
    model loader's line, not the tokenizer's). ``require_head``: a reward model's load — only a saved
    sequence classifier with all its weights, never a fresh head."""
    if not path.startswith(EMBEDDED_PREFIX):
        model_directory(path)
    tokenizer = load_tokenizer(path, "right", trust_remote_code=trust_remote_code)
    if is_sequence_classifier(path):
        model = _saved_classifier(path, dtype, trust_remote_code, require_head)
    elif require_head:
        raise ModelLoadError(f"{path}: {describe_architecture(path)}, not a sequence classifier")
    else:
        lm = load_model(path, dtype=dtype, seed=seed, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
        model = value_head_model(lm, seed=seed)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer
