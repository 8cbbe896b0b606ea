"""Model and tokenizer loading and saving.

``load_model_and_tokenizer("embedded:tiny")`` (or ``embedded:small``) builds the embedded default;
anything else must be a local Hugging Face model directory. Runs are offline: a path that is not a
directory is an error at once (no hub look-up, no retries), whatever it looks like. Weights load
from safetensors only: a directory with only a pickled checkpoint (``pytorch_model.bin``) is
refused, since unpickling can run arbitrary code. A model's own Python code (``auto_map`` in
``config.json``) runs only with ``trust_remote_code=True``. A LoRA adapter directory (peft's
``adapter_config.json``, e.g. a LoRA run's ``final/``) loads as its base model with the adapter
merged in.

Every failure is one line, a ``ModelLoadError`` (a ``ValueError``, which the CLI reports).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .lora import require_peft
from .tiny import build_char_tokenizer, build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBEDDED_PREFIX = "embedded:"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
LOADER_OPTIONS = ("local_files_only", "is_local", "trust_remote_code", "cache_dir", "revision", "token")


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
        if is_adapter_directory(p):
            return p
        raise ModelLoadError(f"no config.json in {path}: not a Hugging Face model directory")
    return p


def is_adapter_directory(path: str | Path) -> bool:
    """A LoRA adapter saved by peft (``adapter_config.json``; e.g. a LoRA run's ``final/``)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / "adapter_config.json").is_file() and not (p / "config.json").is_file()


def adapter_base(path: str | Path) -> str:
    """The base model directory an adapter was trained on (``base_model_name_or_path``), resolved
    as given, then relative to the adapter's own directory; a one-line error when neither exists."""
    import json

    p = Path(path).expanduser()
    try:
        config = json.loads((p / "adapter_config.json").read_text(encoding="utf-8"))
        base = config["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"{p / 'adapter_config.json'}: not a readable adapter config ({first_line(exc)})"
        ) from None
    if not isinstance(base, str) or not base:
        raise ModelLoadError(f"{p / 'adapter_config.json'}: no base_model_name_or_path")
    if base.startswith(EMBEDDED_PREFIX) or Path(base).expanduser().is_dir():
        return base
    beside = p / base
    if beside.is_dir():
        return str(beside)
    raise ModelLoadError(f"{p}: the adapter's base model {base!r} is not a local directory (from here or from {p})")


def load_adapter_model(path: str, dtype, device, gradient_checkpointing: bool, trust_remote_code: bool, seed: int = 0,
                       tokenizer=None):
    """A peft LoRA adapter directory as one plain model: its base, loaded as any model, with the
    adapter applied and merged (W + scale * B A), so sampling, evaluation and further training
    (with or without a new adapter) see exactly the policy the adapter's run trained."""
    peft = require_peft()
    p = Path(path).expanduser()
    if not any(p.glob("adapter_model*.safetensors")):
        pickled = sorted(f.name for f in p.iterdir() if f.suffix in PICKLED_SUFFIXES)
        what = f"pickled adapter {pickled[0]} refused for safety" if pickled else "no adapter_model.safetensors"
        raise ModelLoadError(f"{path}: {what}")
    base = load_model(adapter_base(p), dtype=dtype, device="cpu", seed=seed, tokenizer=tokenizer,
                      trust_remote_code=trust_remote_code)
    try:
        model = peft.PeftModel.from_pretrained(base, str(p), is_trainable=False).merge_and_unload()
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: cannot apply the LoRA adapter ({first_line(exc)})") from None
    return model.requires_grad_(True).to(device)  # peft froze the base; the merged model is an ordinary one


def check_safe_weights(p: Path) -> None:
    """The directory must hold safetensors weights, each of which opens (its header read and its data
    covered: a truncated or damaged file is one line naming it, not a safetensors traceback); a
    pickled checkpoint alone is refused."""
    from safetensors import SafetensorError, safe_open

    files = sorted(p.glob("*.safetensors"))
    for file in files:
        try:
            with safe_open(str(file), "pt"):
                pass
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"{file}: damaged or truncated weights file ({first_line(exc)})") from None
    if files:
        return
    pickled = sorted(f.name for f in p.iterdir() if f.suffix in PICKLED_SUFFIXES)
    if pickled:
        name = "pytorch_model.bin" if "pytorch_model.bin" in pickled else pickled[0]
        raise ModelLoadError(
            f"pickled checkpoint refused for safety: {p} has {name} and no *.safetensors; convert it with "
            "`model.save_pretrained(dir, safe_serialization=True)` where you trust the file"
        )
    raise ModelLoadError(f"no model weights (*.safetensors) in {p}")


def first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _load_error(path: str, what: str, exc: Exception) -> ModelLoadError:
    if "trust_remote_code" in str(exc):
        return ModelLoadError(f"{path} holds its own model code (auto_map); it runs only with trust_remote_code=True")
    return ModelLoadError(f"{path}: cannot load {what} ({first_line(exc)})")


def load_tokenizer(path: str, padding_side: str = "right", trust_remote_code: bool = False):
    if path.startswith(EMBEDDED_PREFIX):
        return prepare_tokenizer(build_char_tokenizer(), padding_side)
    from transformers import AutoTokenizer

    p = model_directory(path, need_config=False)
    if is_adapter_directory(p) and not (p / "tokenizer_config.json").is_file():
        return load_tokenizer(adapter_base(p), padding_side, trust_remote_code)  # an adapter saved without one
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _load_error(path, "a tokenizer", exc) from None
    for option in LOADER_OPTIONS:  # how it was loaded is not part of the tokenizer: never saved with it
        tokenizer.init_kwargs.pop(option, None)
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
    elif is_adapter_directory(path):
        model = load_adapter_model(path, torch_dtype, device, False, trust_remote_code, seed, tokenizer)
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
    if not path.startswith(EMBEDDED_PREFIX) and not is_adapter_directory(path):
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
    config_for_older_loaders(out_dir)
    return out_dir


def config_for_older_loaders(out_dir: str | Path) -> None:
    """Add to a saved ``config.json`` the top-level keys transformers 4.46-4.x reads and 5.x no longer
    writes: ``rope_theta`` (and ``rope_scaling``) from ``rope_parameters``, ``torch_dtype`` from
    ``dtype``. Without ``rope_theta`` transformers 4.57 loads a Llama/Qwen2 with RoPE base 10000, silently
    wrong (interop D11); 5.x and vLLM read the same file unchanged."""
    import json

    path = Path(out_dir) / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    rope, added = config.get("rope_parameters"), {}
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        added["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
            added["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "dtype" in config and "torch_dtype" not in config:
        added["torch_dtype"] = config["dtype"]
    if added:
        path.write_text(json.dumps({**config, **added}, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _umask() -> int:
    try:  # Linux: no change of the process's umask (another thread may create files meanwhile)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readable_like_save_pretrained(directory: str | Path) -> None:
    """Directories 0777 and files 0666 less the umask (0755/0644 under umask 022), as ``save_pretrained``
    into a fresh directory gives: a directory written through ``tempfile.mkdtemp`` (0700) and
    transformers' own 0600 weight files become readable by a serving container or another user
    (interop D10)."""
    import os

    mask = _umask()
    root = Path(directory)
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~mask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)
