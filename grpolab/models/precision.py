"""Float32 logits under bf16 autocast (``logits_fp32``).

Under bf16 autocast the output head's matmul runs in bf16: logits of magnitude ~10-30 carry an
error of ~0.06-0.1 each, and the sampler (lean decoder, one row and one position at a time) and the
trainer (a padded batch) round them differently, so their log-probs of the same token disagree.
``set_logits_fp32(model)`` makes the head compute in float32 on float32 inputs, outside autocast,
wherever it is called from: the trainer's log-probs (``fused_head.response_log_probs``, whose chunked
head calls this forward for each chunk), the Hugging Face rollout forward, and the lean decoder
(``rollout.fast_decoder`` reads ``logits_fp32_enabled``). The rest of the model keeps its autocast
precision. vLLM computes its own logits and is not affected.

The switch is an instance-level ``forward`` of the head module (a bound method), so it follows the
module through ``copy.deepcopy`` (the sampler's replica, the frozen reference), LoRA and engine
wrappers; state dicts and saved model directories are unchanged.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .fused_head import unwrap_model


def _fp32_head_forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        if type(self) is torch.nn.Linear:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(hidden.float(), self.weight.float(), bias)
        return type(self).forward(self, hidden.float(), *args, **kwargs)


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
    forward = head.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _fp32_head_forward


def set_logits_fp32(model, on: bool = True):
    """Compute ``model``'s logits (output head matmul, hence every log-softmax downstream) in float32
    even under bf16 autocast (``on=False`` restores the head's own forward). Returns ``model``."""
    head = output_projection(model)
    if on:
        head.forward = types.MethodType(_fp32_head_forward, head)
    elif logits_fp32_enabled(model):
        del head.forward
    return model
