"""What a ``Run`` sets up before its directory is touched: the seeds (in one place), the device and
the CPU threads, the model — from the checkpoint it resumes from, else the one given, else
``cfg.model`` — with dropout off, bf16 autocast, and the tool environment."""

from __future__ import annotations

import contextlib
import os
import random
import sys

import torch

from ..envs import build_env
from ..envs.vf import build_vf_env
from ..models import set_logits_fp32
from .config import ConfigError
from .resources import choose_cpu_threads, choose_dtype, keep_freed_memory, model_shape


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, torch (and numpy when present) in one place; optionally deterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def autocast_for(dtype: str, device: torch.device | str):
    """bf16 autocast (weights stay fp32) where asked, else a no-op context."""
    if dtype == "bfloat16":
        device_type = torch.device(device).type
        return lambda: torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def resolve_device(device: str, field: str = "device") -> torch.device:
    """``auto``: cuda when available, else cpu; a named device must exist on this machine, else one
    ``ConfigError`` naming ``field`` (a CPU-only torch asked for cuda, a GPU index past the last)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ConfigError(f"{field}: {device!r}, but this torch ({torch.__version__}, {build}) sees no CUDA "
                              f"device; set {field}: cpu (or auto), or install a CUDA build of torch")
        if resolved.index is not None and resolved.index >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ConfigError(f"{field}: {device!r}, but this machine shows {count} CUDA device(s) "
                              f"(cuda:0..cuda:{count - 1}; CUDA_VISIBLE_DEVICES={visible})")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{field}: {device!r}, but this torch has no MPS device; set {field}: cpu (or auto)")
    return resolved


def set_cpu_threads(cfg, device: torch.device, probe: bool) -> None:
    """On a CPU: torch's threads (``cfg.threads``, else what a short probe finds faster, when ``probe``).
    With a sampler process (``max_staleness >= 1``, the hf backend) and neither ``threads`` nor
    ``OMP_NUM_THREADS`` given, the trainer takes the cores the sampler's ``sampler_threads`` leave.
    ``cfg.keep_freed_memory``: glibc keeps freed blocks for reuse (``resources.keep_freed_memory``).
    A ``sampler_threads`` that no sampler process uses is said in one line (reliability case A06)."""
    sampler_process = getattr(cfg, "max_staleness", 0) and getattr(cfg, "rollout_backend", "hf") == "hf"
    if getattr(cfg, "sampler_threads", 1) != 1 and not sampler_process:
        print(f"grpolab: sampler_threads {cfg.sampler_threads} is not used: it sets the threads of the sampler "
              "process, which only max_staleness >= 1 with rollout_backend hf starts", file=sys.stderr)
    if device.type == "cpu":
        if getattr(cfg, "keep_freed_memory", False):
            keep_freed_memory()
        threads = cfg.threads
        if threads is None and getattr(cfg, "max_staleness", 0) and getattr(cfg, "rollout_backend", "hf") == "hf" \
                and not os.environ.get("OMP_NUM_THREADS"):
            threads = max(1, torch.get_num_threads() - cfg.sampler_threads)
            print(f"grpolab: torch threads: {threads} for the trainer, {cfg.sampler_threads} for the sampler "
                  "process (set threads and sampler_threads to choose)", file=sys.stderr)
        _, line = choose_cpu_threads(threads, probe=probe)
        if line:
            print(f"grpolab: {line}", file=sys.stderr)


def resolve_auto_dtype(cfg, model, device: torch.device, probe: bool) -> None:
    """``dtype: auto`` settled for this machine and model (``resources.choose_dtype``), said in one
    line and written back to ``cfg`` (so the run directory's config records it); bf16 brings fp32
    logits. ``probe`` false (torchrun ranks, deterministic runs): the CPU's flags decide alone."""
    if getattr(cfg, "dtype", None) != "auto":
        return
    kw = {} if probe else {"measure": None}
    cfg.dtype, line = choose_dtype("auto", device, model_shape(model), **kw)
    if cfg.dtype == "bfloat16":
        if "logits_fp32" in getattr(cfg, "model_fields_set", ()) and not cfg.logits_fp32:  # T03: kept as given
            line = line.replace("logits and log-softmax in fp32", "logits in bf16: logits_fp32 false as given")
        else:
            cfg.logits_fp32 = True  # load_run_model then puts the head in fp32
    print(f"grpolab: {line} (set dtype to choose)", file=sys.stderr)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere (TRL's convention): log-probs that enter a ratio or a KL must be of
    the same distribution the sampler drew from."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def load_run_model(cfg, load_model, resumed_from=None, model=None, tokenizer=None, *, device=None, probe=False):
    """(model, tokenizer): from the checkpoint ``resumed_from``, else ``model`` as given, else
    ``cfg.model`` (by ``load_model(path, **options)``); dropout off, ``dtype: auto`` settled for
    ``device`` (``resolve_auto_dtype``) and the head in fp32 as the config asks, before any copy
    (sampler replica, reference) is made."""
    gc = {"gradient_checkpointing": True} if cfg.gradient_checkpointing else {}
    if resumed_from is not None:
        model, tokenizer = load_model(str(resumed_from), trust_remote_code=cfg.trust_remote_code, **gc)
    elif model is None:
        model, tokenizer = load_model(cfg.model, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code, **gc)
    if cfg.disable_dropout:
        disable_dropout(model)
    resolve_auto_dtype(cfg, model, torch.device(device or "cpu"), probe)
    if getattr(cfg, "logits_fp32", False):
        set_logits_fp32(model)
    return model, tokenizer


def build_run_env(cfg, tokenizer):
    """The run's tool environment (``env:``), or None: its tools, custom tool modules and
    retrieval index are built (and so checked) before the run directory is touched."""
    options = getattr(cfg, "env", None)
    if options is None:
        return None
    if options.get("verifiers"):  # a verifiers environment: None for a single-turn one (nothing runs between turns)
        return build_vf_env(**options, tokenizer=tokenizer)
    return build_env(**options, tokenizer=tokenizer)
