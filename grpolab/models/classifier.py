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


def is_sequence_classifier(path: str) -> bool:
    """A directory whose ``config.json`` names a ``*ForSequenceClassification`` architecture."""
    if path.startswith(EMBEDDED_PREFIX):
        return False
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


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


def load_sequence_classifier(path: str, dtype="float32", device="cpu", seed: int = 0, trust_remote_code: bool = False):
    """``(model, tokenizer)``: a sequence classifier as saved, or a causal LM with a value head
    (see the module doc); the model's ``pad_token_id`` is the tokenizer's (the last non-pad token
    is where the score is read)."""
    tokenizer = load_tokenizer(path, "right", trust_remote_code=trust_remote_code)
    if is_sequence_classifier(path):
        from transformers import AutoModelForSequenceClassification

        p = model_directory(path)
        check_safe_weights(p)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(p), dtype=resolve_dtype(dtype), use_safetensors=True, local_files_only=True,
                trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot load a sequence classifier ({first_line(exc)})") from None
    else:
        lm = load_model(path, dtype=dtype, seed=seed, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
        model = value_head_model(lm, seed=seed)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer
