"""Sampler/trainer importance-sampling correction: truncated (TIS) or masked (MIS) IS weights.

The sampler (vLLM, a fast decode loop, another precision) and the trainer compute slightly
different probabilities for the same tokens, so a rollout is off-policy even at "old" = current
weights. Weighting each token's policy-gradient loss by ``pi_old_trainer / pi_sampler`` corrects
the expectation (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training": truncated IS; Liu et al. 2025, "When Speed Kills Stability": masked IS and
sequence-level ratios). ``grpo_microbatch_train_step(..., is_weights=...)`` applies the weights.

A response's ratio is length-invariant by default: the geometric mean of its token ratios
(GSPO, Zheng et al. 2025, eq. 7; veRL's ``geometric``), since the product of T token ratios
shrinks or grows exponentially with T (4000 tokens at log-ratio -0.0007 each: 0.061 as a product,
0.9993 as a geometric mean; NeMo-RL PR #2269). The product (the likelihood ratio of the whole
response) stays available as ``sequence_product``. IcePop (Ling team 2025, "Every Step Evolves")
masks tokens whose ratio leaves a band ``[low, high]`` (typically [0.5, 2]) out of the gradient,
on top of either mode and level.
"""

from __future__ import annotations

import math

import torch

IS_MODES = ("tis", "mis")
IS_LEVELS = ("token", "sequence", "sequence_product")


def _check(mode: str, level: str, cap: float, band: tuple[float | None, float | None]) -> None:
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {', '.join(IS_MODES)}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; expected one of {', '.join(IS_LEVELS)}")
    if not cap >= 1.0:  # also rejects NaN
        raise ValueError(f"importance-sampling cap must be >= 1, got {cap!r}")
    low, high = band
    if low is not None and not 0.0 < low <= 1.0:
        raise ValueError(f"importance-sampling mask_low must be in (0, 1], got {low!r}")
    if high is not None and not high >= 1.0:
        raise ValueError(f"importance-sampling mask_high must be >= 1, got {high!r}")


def importance_sampling_weights(
    trainer_old_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
    mask_low: float | None = None,
    mask_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached IS weights (batch, seq) for the sampler/trainer mismatch, and their statistics.

    ``rho = pi_old_trainer / pi_sampler`` per token (``level="token"``: ``exp(old - sampler)``), or
    one per response broadcast to its tokens: ``level="sequence"``, the geometric mean of its token
    ratios ``exp(mean over the response's tokens of (old - sampler))`` (GSPO's sequence ratio;
    veRL's ``geometric``), or ``level="sequence_product"``, their product ``exp(sum ...)`` (the
    likelihood ratio of the whole response, which shrinks or grows with its length).
    ``mode="tis"`` (truncated IS): ``w = min(rho, cap)``. ``mode="mis"`` (masked IS): ``w = rho``
    where ``1/cap <= rho <= cap``, else 0, which drops the token (or the whole sequence) from the
    gradient. ``mask_low`` / ``mask_high`` (IcePop; None: no bound on that side): a token whose own
    ratio lies outside ``[mask_low, mask_high]`` gets weight 0 whatever the level. Weights are 0
    outside ``response_mask``; inputs are log-probs (batch, seq), masked-out entries may hold anything.

    Stats (0-d tensors), over the response's tokens (token level) or over the sequences with at
    least one response token (sequence levels), of ``rho`` *before* truncation: ``is_ratio_mean``,
    ``is_ratio_max`` and ``is_truncated_fraction`` (TIS: ``rho > cap``; MIS: ``rho`` outside
    ``[1/cap, cap]``); with a band, ``is_band_masked_fraction``: the share of response tokens it
    masks. A product ratio that overflows is inf: its TIS weight is ``cap``, its MIS weight 0, and
    the mean and max report inf.
    """
    _check(mode, level, cap, (mask_low, mask_high))
    mask = response_mask.bool()
    dtype = torch.promote_types(trainer_old_log_probs.dtype, torch.float32)
    diff = (trainer_old_log_probs.detach() - sampler_log_probs.detach()).to(dtype)
    log_ratio = torch.where(mask, diff, torch.zeros((), dtype=dtype, device=diff.device))
    if level == "sequence":
        lengths = mask.sum(-1).clamp(min=1).to(dtype)
        unit_ratio, unit_mask = torch.exp(log_ratio.sum(-1) / lengths), mask.any(-1)
    elif level == "sequence_product":
        unit_ratio, unit_mask = torch.exp(log_ratio.sum(-1)), mask.any(-1)
    else:
        unit_ratio, unit_mask = torch.exp(log_ratio), mask
    if mode == "tis":
        truncated = unit_ratio > cap
        unit_weights = torch.clamp(unit_ratio, max=cap)
    else:
        truncated = (unit_ratio > cap) | (unit_ratio < 1.0 / cap)
        unit_weights = torch.where(truncated, torch.zeros_like(unit_ratio), unit_ratio)
    weights = unit_weights.unsqueeze(-1).expand_as(log_ratio) if level != "token" else unit_weights
    stats = _stats(unit_ratio, unit_mask, truncated)
    if mask_low is not None or mask_high is not None:
        outside = torch.zeros_like(mask)  # compared in log space: no overflow, no rounding of exp
        if mask_low is not None:
            outside |= log_ratio < math.log(mask_low)
        if mask_high is not None:
            outside |= log_ratio > math.log(mask_high)
        outside &= mask
        weights = torch.where(outside, torch.zeros_like(weights), weights)
        stats["is_band_masked_fraction"] = outside.sum().to(dtype) / mask.sum().clamp(min=1).to(dtype)
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    return weights, stats


def _stats(ratio: torch.Tensor, unit_mask: torch.Tensor, truncated: torch.Tensor) -> dict[str, torch.Tensor]:
    count = unit_mask.sum().clamp(min=1).to(ratio.dtype)
    kept = torch.where(unit_mask, ratio, torch.zeros_like(ratio))
    return {
        "is_ratio_mean": kept.sum() / count,
        "is_ratio_max": kept.max() if kept.numel() else kept.sum(),
        "is_truncated_fraction": (truncated & unit_mask).sum().to(ratio.dtype) / count,
    }
