"""Model and tokenizer loading/saving, and the embedded tiny model.

``load_model_and_tokenizer("embedded:tiny")`` (or ``embedded:small``) builds the embedded default;
anything else is a local Hugging Face directory (or a hub name when the user is online). Weights
load from safetensors; ``.bin`` files go through transformers' ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tiny import TINY_SIZES, build_char_tokenizer, build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBEDDED_PREFIX = "embedded:"


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


def load_tokenizer(path: str, padding_side: str = "right"):
    if path.startswith(EMBEDDED_PREFIX):
        return prepare_tokenizer(build_char_tokenizer(), padding_side)
    from transformers import AutoTokenizer

    _check_local(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot load a tokenizer ({_first_line(exc)})") from None
    return prepare_tokenizer(tokenizer, padding_side)


def _check_local(path: str) -> None:
    """A path that is clearly local (not a hub name) must exist."""
    if path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():
        raise ValueError(f"{path}: no such model directory")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load_model(
    path: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
    seed: int = 0,
    tokenizer=None,
):
    """A causal LM from a local directory (or ``embedded:tiny|small``), in ``dtype`` on ``device``."""
    torch_dtype = resolve_dtype(dtype)
    if path.startswith(EMBEDDED_PREFIX):
        model = build_tiny_model(path[len(EMBEDDED_PREFIX) :], tokenizer=tokenizer, seed=seed)
        model = model.to(dtype=torch_dtype)
    else:
        from transformers import AutoModelForCausalLM

        _check_local(path)
        p = Path(path)
        if p.exists() and not (p / "config.json").exists():
            raise ValueError(f"{path}: not a Hugging Face model directory (no config.json)")
        kwargs = {"dtype": torch_dtype}
        if p.is_dir() and any(p.glob("*.safetensors")):
            kwargs["use_safetensors"] = True
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot load a causal LM ({_first_line(exc)})") from None
    model = model.to(device)
    if gradient_checkpointing:
        # transformers 5 renamed it; 4.x has only the old name
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.config.use_cache = False
    return model


def load_model_and_tokenizer(path: str, padding_side: str = "right", **kwargs):
    tokenizer = load_tokenizer(path, padding_side)
    return load_model(path, tokenizer=tokenizer, **kwargs), tokenizer


def save_model_and_tokenizer(model, tokenizer, out_dir: str | Path) -> Path:
    """``save_pretrained`` (safetensors) for both: the directory loads in transformers and vLLM."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


__all__ = [
    "DTYPES", "EMBEDDED_PREFIX", "TINY_SIZES", "build_char_tokenizer", "build_tiny_model", "load_model",
    "load_model_and_tokenizer", "load_tokenizer", "prepare_tokenizer", "resolve_dtype",
    "save_model_and_tokenizer",
]
