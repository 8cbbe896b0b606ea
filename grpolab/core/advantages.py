"""Advantage estimators: group-normalised rewards (GRPO) and GAE (PPO).

Per-response estimators are registered by name (``registry.register_advantage_estimator``) and
called through ``compute_advantages``; "grpo" is the group-normalised estimator.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .registry import get_advantage_estimator, register_advantage_estimator


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, Any], dict[str, float]],
    rollout_responses: Sequence[str],
    repeated_ground_truths: Sequence[Any],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """GRPO advantages (Shao et al. 2024, DeepSeekMath eq. 3; CS336 A5 §7.2).

    Groups are consecutive blocks of ``group_size`` responses. The advantage of a response is its
    reward minus the group mean, divided by ``(group std + advantage_eps)`` when
    ``normalize_by_std`` (std with Bessel's correction, as ``torch.std``). Without it this is Dr.
    GRPO's unbiased mean-only baseline (Liu et al. 2025).

    Returns ``(advantages (N,), raw_rewards (N,), metadata)``, both tensors float32.
    """
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    n = len(rollout_responses)
    if n != len(repeated_ground_truths):
        raise ValueError(f"got {n} responses but {len(repeated_ground_truths)} ground truths")
    if n % group_size != 0:
        raise ValueError(f"{n} responses do not split into groups of group_size={group_size}")
    scores = [reward_fn(r, gt) for r, gt in zip(rollout_responses, repeated_ground_truths)]
    raw_rewards = torch.tensor([float(s["reward"]) for s in scores], dtype=torch.float32)
    advantages = normalize_group_rewards(raw_rewards, group_size, advantage_eps, normalize_by_std)
    grouped = raw_rewards.view(-1, group_size)
    metadata = {
        "reward_mean": raw_rewards.mean().item(),
        "reward_std": raw_rewards.std().item() if n > 1 else 0.0,
        "reward_max": raw_rewards.max().item(),
        "reward_min": raw_rewards.min().item(),
        "format_reward_mean": sum(float(s.get("format_reward", 0.0)) for s in scores) / n,
        "answer_reward_mean": sum(float(s.get("answer_reward", 0.0)) for s in scores) / n,
        "zero_variance_group_fraction": (grouped.max(1).values == grouped.min(1).values).float().mean().item(),
    }
    return advantages, raw_rewards, metadata


def normalize_group_rewards(
    raw_rewards: torch.Tensor, group_size: int, advantage_eps: float, normalize_by_std: bool
) -> torch.Tensor:
    """The tensor half of ``compute_group_normalized_rewards``: (N,) rewards -> (N,) advantages.

    A group whose rewards are all equal (including a group of one) carries no signal: its
    advantages are exactly 0 for any ``advantage_eps`` (also 0, where ``0 / 0`` would be NaN) and
    with or without std normalisation.
    """
    # Reduced in float64 so a group of near-equal rewards is not swamped by rounding; float32 out.
    grouped = raw_rewards.double().view(-1, group_size)
    zero_variance = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std:
        # torch.std of a group of one is NaN (with a warning); such a group is zero-variance anyway.
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centered[:, :1])
        centered = centered / torch.where(zero_variance, torch.ones_like(std), std + advantage_eps)
    centered = torch.where(zero_variance, torch.zeros_like(centered), centered)
    return centered.reshape(-1).to(torch.float32)


@register_advantage_estimator("grpo")
def grpo_advantages(
    raw_rewards: torch.Tensor,
    group_size: int,
    *,
    advantage_eps: float = 1e-6,
    use_std_normalization: bool = True,
    **_: Any,
) -> torch.Tensor:
    """Registered estimator "grpo": group-normalised rewards (Shao et al. 2024 eq. 3; CS336 A5).

    (N,) rewards -> (N,) float32 advantages; the defaults are CS336's. Options it does not use are
    ignored (see ``registry.AdvantageEstimator``).
    """
    return normalize_group_rewards(raw_rewards, group_size, advantage_eps, use_std_normalization)


def compute_advantages(estimator: str, raw_rewards: torch.Tensor, group_size: int, **options: Any) -> torch.Tensor:
    """Advantages from the registered ``estimator`` ("grpo", ...): (N,) rewards -> (N,) or (N, seq).

    ``options`` are the estimator's keywords, e.g. ``advantage_eps`` and ``use_std_normalization``
    for "grpo". Unknown names raise ValueError listing the registered ones.
    """
    return get_advantage_estimator(estimator)(raw_rewards, group_size, **options)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, eq. 16) per token.

    ``rewards``, ``values`` and ``response_mask`` are (B, T) for right-padded variable-length
    responses. The episode ends after a response's last token, so the value after it is 0:
    ``delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1}``. Returns ``(advantages, returns)``, each
    (B, T), with ``returns = advantages + values`` and 0 at positions outside the mask.
    The seed design uses gamma=0.99, lam=0.95; for LM RLHF gamma=1.0, lam=0.95 is also common.
    """
    mask = response_mask.to(rewards.dtype)
    rewards = rewards * mask
    values = values.detach() * mask
    batch, length = rewards.shape
    next_mask = torch.cat([mask[:, 1:], torch.zeros(batch, 1, dtype=mask.dtype, device=mask.device)], dim=1)
    next_values = torch.cat([values[:, 1:], torch.zeros(batch, 1, dtype=values.dtype, device=values.device)], dim=1)
    deltas = rewards + gamma * next_values * next_mask - values
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    for t in range(length - 1, -1, -1):
        running = deltas[:, t] + gamma * lam * next_mask[:, t] * running
        advantages[:, t] = running
    advantages = advantages * mask
    returns = (advantages + values) * mask
    return advantages, returns
