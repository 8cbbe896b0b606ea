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
from ..rollout import make_backend
from ..rollout.vllm import check_vllm_options
from ..rollout.vllm_server import check_vllm_server_options
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


def check_backend(cfg, policy: torch.device) -> None:
    """The rollout backend's options on this machine (``rollout_backend``, ``vllm_*``), before the run
    directory is touched: one line each (vLLM importable, sleep mode with CUDA, ``vllm_device``)."""
    check_vllm_device(cfg, policy)
    backend = getattr(cfg, "rollout_backend", "hf")
    if backend == "vllm":
        check_vllm_options(**cfg.backend_options())
    elif backend == "vllm_server":
        check_vllm_server_options(**cfg.backend_options())


def run_backend(run, generator: torch.Generator | None = None):
    """The configured rollout backend of ``run`` (``rollout_backend``: hf, a colocated vLLM engine, a
    vLLM server, with the config's ``vllm_*`` knobs) over its sampling model. An engine holds its own
    weights: ``run.weights.sync(backend)`` gives it the current ones; the caller closes it."""
    cfg = run.cfg
    if run.device.type == "cuda" and run.device.index is not None and cfg.rollout_backend != "hf":
        torch.cuda.set_device(run.device)  # the weight transfer's trainer end (NCCL) is the current GPU: the policy's
    return make_backend(cfg.rollout_backend, run.sampling_model, run.tokenizer,
                        max_batch_size=cfg.rollout_max_batch_size,
                        autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None, generator=generator,
                        **cfg.backend_options())


def check_vllm_device(cfg, policy: torch.device) -> None:
    """``vllm_device`` on this machine, before the run directory is touched: a device it has, the
    colocated engine only on the policy's device (it runs in the trainer's process), no CPU engine
    beside CUDA (the weights then move by NCCL, GPU to GPU). One ``ConfigError`` line otherwise."""
    if getattr(cfg, "vllm_device", None) is None:
        return
    engine = resolve_device(cfg.vllm_device, "vllm_device")
    if engine.type == "cpu" and torch.cuda.is_available():
        raise ConfigError(f"vllm_device: {cfg.vllm_device!r} on a machine with CUDA: vLLM's CUDA build runs on a GPU "
                          "and the weights move to it by NCCL; name a GPU (cuda:N) or leave vllm_device unset")
    index = lambda d: (d.type, d.index or 0 if d.type == "cuda" else None)  # noqa: E731 - cuda is cuda:0
    if cfg.rollout_backend == "vllm" and index(engine) != index(policy):
        raise ConfigError(f"vllm_device: {cfg.vllm_device!r}, but rollout_backend vllm runs the engine in the "
                          f"trainer's process, on the policy's device ({policy}); for vLLM on another GPU use "
                          "rollout_backend: vllm_server")


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
