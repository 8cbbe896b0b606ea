"""Sampler/trainer importance-sampling correction: truncated (TIS) or masked (MIS) IS weights.

The sampler (vLLM, a fast decode loop, another precision) and the trainer compute slightly
different probabilities for the same tokens, so a rollout is off-policy even at "old" = current
weights. Weighting each token's policy-gradient loss by ``pi_old_trainer / pi_sampler`` corrects
the expectation (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training": truncated IS; Liu et al. 2025, "When Speed Kills Stability": masked IS and
sequence-level ratios). ``grpo_microbatch_train_step(..., is_weights=...)`` applies the weights.
"""

from __future__ import annotations

import torch

IS_MODES = ("tis", "mis")
IS_LEVELS = ("token", "sequence")


def _check(mode: str, level: str, cap: float) -> None:
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {', '.join(IS_MODES)}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; expected one of {', '.join(IS_LEVELS)}")
    if not cap >= 1.0:  # also rejects NaN
        raise ValueError(f"importance-sampling cap must be >= 1, got {cap!r}")


def importance_sampling_weights(
    trainer_old_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached IS weights (batch, seq) for the sampler/trainer mismatch, and their statistics.

    ``rho = pi_old_trainer / pi_sampler`` per token (``level="token"``: ``exp(old - sampler)``) or
    per sequence (``level="sequence"``: ``exp(sum over the response's tokens of (old - sampler))``,
    the likelihood ratio of the whole response, broadcast to its tokens). ``mode="tis"`` (truncated
    IS): ``w = min(rho, cap)``. ``mode="mis"`` (masked IS): ``w = rho`` where ``1/cap <= rho <= cap``,
    else 0, which drops the token (or the whole sequence) from the gradient. Weights are 0 outside
    ``response_mask``; inputs are log-probs (batch, seq), masked-out entries may hold anything.

    Stats (0-d tensors), over the response's tokens (token level) or over the sequences with at
    least one response token (sequence level), of ``rho`` *before* truncation: ``is_ratio_mean``,
    ``is_ratio_max`` and ``is_truncated_fraction`` (TIS: ``rho > cap``; MIS: ``rho`` outside
    ``[1/cap, cap]``). A sequence ratio that overflows is inf: its TIS weight is ``cap``, its MIS
    weight 0, and the mean and max report inf.
    """
    _check(mode, level, cap)
    mask = response_mask.bool()
    dtype = torch.promote_types(trainer_old_log_probs.dtype, torch.float32)
    diff = (trainer_old_log_probs.detach() - sampler_log_probs.detach()).to(dtype)
    log_ratio = torch.where(mask, diff, torch.zeros((), dtype=dtype, device=diff.device))
    if level == "sequence":
        unit_ratio, unit_mask = torch.exp(log_ratio.sum(-1)), mask.any(-1)
    else:
        unit_ratio, unit_mask = torch.exp(log_ratio), mask
    if mode == "tis":
        truncated = unit_ratio > cap
        unit_weights = torch.clamp(unit_ratio, max=cap)
    else:
        truncated = (unit_ratio > cap) | (unit_ratio < 1.0 / cap)
        unit_weights = torch.where(truncated, torch.zeros_like(unit_ratio), unit_ratio)
    weights = unit_weights.unsqueeze(-1).expand_as(log_ratio) if level == "sequence" else unit_weights
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    return weights, _stats(unit_ratio, unit_mask, truncated)


def _stats(ratio: torch.Tensor, unit_mask: torch.Tensor, truncated: torch.Tensor) -> dict[str, torch.Tensor]:
    count = unit_mask.sum().clamp(min=1).to(ratio.dtype)
    kept = torch.where(unit_mask, ratio, torch.zeros_like(ratio))
    return {
        "is_ratio_mean": kept.sum() / count,
        "is_ratio_max": kept.max() if kept.numel() else kept.sum(),
        "is_truncated_fraction": (truncated & unit_mask).sum().to(ratio.dtype) / count,
    }
