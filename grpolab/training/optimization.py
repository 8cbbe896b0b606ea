"""Optimizer, learning-rate schedule and the optimizer step every trainer uses.

The step is guarded: a non-finite loss or gradient norm skips the update (weights, AdamW moments
and the schedule stay as they were) and is counted. A finite update can still make the weights
non-finite (an infinite learning rate, an overflow); ``nonfinite_parameters`` counts those, and the
run stops on them (``Run.optimizer_step``) before a checkpoint is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def make_optimizer(model, learning_rate: float, betas=(0.9, 0.95), weight_decay: float = 0.0, eps: float = 1e-8):
    """AdamW (CS336 defaults: betas (0.9, 0.95), weight decay 0) over the trainable parameters.

    Fused (one kernel over every tensor, no full-size temporaries) where torch has the kernel: plain
    floating-point tensors on the CPU or a GPU. SmolLM2-135M on 2 AVX2 cores: 0.52 s -> 0.08 s a
    step; the same update to float32 rounding. FSDP2's DTensor shards keep the default."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() and not hasattr(p, "to_local") for p in params
    )
    return torch.optim.AdamW(
        params, lr=learning_rate, betas=tuple(betas), weight_decay=weight_decay, eps=eps, fused=fused or None
    )


def effective_warmup(warmup_steps: int, total_steps: int) -> int:
    """Warm-up never takes more than 10 % of a run (the seed design's rule for short runs)."""
    return max(0, min(warmup_steps, int(0.1 * total_steps)))


def make_scheduler(optimizer, warmup_steps: int, total_steps: int, kind: str = "constant", min_lr_ratio: float = 0.0):
    """Linear warm-up over ``warmup_steps`` optimizer steps, then constant or cosine decay."""
    if kind not in ("constant", "cosine"):
        raise ValueError(f"unknown lr_schedule {kind!r}; expected constant or cosine")

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class StepResult:
    """What one guarded optimizer step did: the gradient norm before clipping, and whether the
    update was skipped because the loss or the gradient was not finite."""

    grad_norm: float
    skipped: bool = False


def optimizer_step(model, optimizer, scheduler, max_grad_norm: float | None, loss: float | None = None) -> StepResult:
    """Clip, step, zero — unless ``loss`` or the gradient norm is NaN/inf, in which case the
    gradient is dropped and nothing moves (weights, optimizer moments, schedule).

    Parameters that got no gradient (every row skipped) get zeros, so AdamW's moments move exactly
    as if the zero gradient had been computed."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if max_grad_norm:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    else:
        grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    skipped = not math.isfinite(grad_norm) or (loss is not None and not math.isfinite(float(loss)))
    if not skipped:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(grad_norm, skipped)


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def nonfinite_parameters(optimizer) -> tuple[int, int]:
    """(how many of the tensors ``optimizer`` updates hold a NaN or an inf, how many tensors it
    updates), on this process: an FSDP2 parameter's local shard, ZeRO's flat partitions. One pass of
    sums (a NaN or an inf makes its tensor's sum non-finite), one host sync; a non-finite sum is
    checked element-wise, since a sum of huge finite values can overflow too."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = [t.detach() for t in (p.to_local() if hasattr(p, "to_local") else p for p in params) if t.numel()]
    if not local:
        return 0, len(params)
    device = local[0].device
    sums = torch.stack([t.sum().float().to(device) for t in local])
    flagged = torch.nonzero(~torch.isfinite(sums)).flatten().tolist()
    return sum(not bool(torch.isfinite(local[i]).all()) for i in flagged), len(params)
