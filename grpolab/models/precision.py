"""Float32 logits under bf16 autocast (``logits_fp32``).

Under bf16 autocast the output head's matmul runs in bf16: logits of magnitude ~10-30 carry an
error of ~0.06-0.1 each, and the sampler (lean decoder, one row and one position at a time) and the
trainer (a padded batch) round them differently, so their log-probs of the same token disagree.
``set_logits_fp32(model)`` makes the head compute in float32 on float32 inputs, outside autocast,
wherever it is called from: the trainer's log-probs (``fused_head.response_log_probs``, whose chunked
head calls this forward for each chunk), the Hugging Face rollout forward, and the lean decoder
(``rollout.fast_decoder`` reads ``logits_fp32_enabled``). The rest of the model keeps its autocast
precision. vLLM computes its own logits and is not affected.

The switch is an instance-level ``forward`` of the head module (``Fp32HeadForward``, a callable
bound to its head like a method), so it follows the module through ``copy.deepcopy`` (the sampler's
replica, the frozen reference), pickling (the spawned sampler process of ``max_staleness >= 1``:
a plain bound method does not unpickle, C5-2), LoRA and engine wrappers; state dicts and saved
model directories are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused_head import unwrap_model


def _fp32_head_forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        if type(self) is torch.nn.Linear:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(hidden.float(), self.weight.float(), bias)
        return type(self).forward(self, hidden.float(), *args, **kwargs)


class Fp32HeadForward:
    """``_fp32_head_forward`` bound to ``head`` (``__self__``, as a bound method): stored as the head's
    instance ``forward``. Unlike ``types.MethodType`` it pickles (with its head, which the pickle
    memo resolves) as well as it deep-copies."""

    def __init__(self, head: torch.nn.Module):
        self.__self__ = head

    @property
    def __func__(self):
        return _fp32_head_forward

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return _fp32_head_forward(self.__self__, hidden, *args, **kwargs)


def output_projection(model) -> torch.nn.Module:
    """The model's output head (``get_output_embeddings()``), through DDP/DeepSpeed/peft wrappers."""
    inner = unwrap_model(model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"logits_fp32: {type(inner).__name__} has no output head (get_output_embeddings)")
    return head


def logits_fp32_enabled(model) -> bool:
    """Whether ``set_logits_fp32`` is on for ``model``'s output head."""
    try:
        head = output_projection(model)
    except ValueError:
        return False
    return isinstance(head.__dict__.get("forward"), Fp32HeadForward)


def set_logits_fp32(model, on: bool = True):
    """Compute ``model``'s logits (output head matmul, hence every log-softmax downstream) in float32
    even under bf16 autocast (``on=False`` restores the head's own forward). Returns ``model``."""
    head = output_projection(model)
    if on:
        head.forward = Fp32HeadForward(head)
    elif logits_fp32_enabled(model):
        del head.forward
    return model
