"""Generation backends behind one interface (see ``base``)."""

from .base import FINISH_REASONS, Rollout, RolloutBackend, SamplingParams
from .hf import HFRolloutBackend


def make_backend(name: str, model, tokenizer, **kwargs) -> RolloutBackend:
    """``hf`` (Hugging Face model, any device). ``vllm`` is planned; it will need a GPU and weight sync."""
    if name == "hf":
        return HFRolloutBackend(model, tokenizer, **kwargs)
    if name == "vllm":
        raise ValueError("rollout backend 'vllm' is not available yet; use 'hf'")
    raise ValueError(f"unknown rollout backend {name!r}; expected 'hf'")


__all__ = ["FINISH_REASONS", "HFRolloutBackend", "Rollout", "RolloutBackend", "SamplingParams", "make_backend"]
