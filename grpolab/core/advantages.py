"""Advantage estimators: group-normalised rewards (GRPO), RLOO, REINFORCE++ and GAE (PPO).

Per-response estimators are registered by name (``registry.register_advantage_estimator``) and
called through ``compute_advantages``: "grpo" (group-normalised, ``scale_rewards``), "rloo"
(leave-one-out baseline) and "reinforce_plus_plus" (batch-normalised, ``group_baseline``).
``compute_gae`` is PPO's token-level estimator: it needs per-token rewards and a value model's
values (N, seq), not the registry's ``(raw_rewards (N,), group_size)``, so it is not registered
and not selectable as a GRPO ``advantage_estimator``.
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
    return _group_centered(raw_rewards, group_size, advantage_eps, "group" if normalize_by_std else "none")


SCALE_REWARDS = ("group", "batch", "none")


def _std_or_zero(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel std (as ``torch.std``) over all of ``x`` (0-d) or over ``dim`` (keepdim); 0 where
    there is a single element (torch.std would give NaN and a warning)."""
    if dim is None:
        return x.std() if x.numel() > 1 else x.new_zeros(())
    return x.std(dim=dim, keepdim=True) if x.shape[dim] > 1 else torch.zeros_like(x.narrow(dim, 0, 1))


def _group_centered(raw_rewards: torch.Tensor, group_size: int, advantage_eps: float, scale: str) -> torch.Tensor:
    """(N,) -> (N,) float32: reward minus its group mean, divided by ``std + advantage_eps`` where
    the std is the group's (``scale="group"``), the whole batch's rewards' (``"batch"``) or 1
    (``"none"``). Zero-variance groups give exactly 0."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale!r}; expected one of {', '.join(SCALE_REWARDS)}")
    # Reduced in float64 so a group of near-equal rewards is not swamped by rounding; float32 out.
    grouped = raw_rewards.double().view(-1, group_size)
    zero_variance = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale != "none":
        # torch.std of a group of one is NaN (with a warning); such a group is zero-variance anyway.
        std = _std_or_zero(grouped, dim=1) if scale == "group" else _std_or_zero(grouped).expand(len(grouped), 1)
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
    scale_rewards: str | None = None,
    **_: Any,
) -> torch.Tensor:
    """Registered estimator "grpo": group-normalised rewards (Shao et al. 2024 eq. 3; CS336 A5).

    ``A_i = (r_i - mean(group)) / (std + advantage_eps)``, (N,) rewards -> (N,) float32 advantages;
    the defaults are CS336's. ``scale_rewards`` picks the std: ``"group"`` (the group's, GRPO),
    ``"batch"`` (the std of the whole batch's rewards, TRL's ``scale_rewards="batch"``: a group with
    a small spread is not blown up) or ``"none"`` (mean-centred only: Dr. GRPO, Liu et al. 2025).
    Precedence: an explicit ``scale_rewards`` wins; when it is None, ``use_std_normalization``
    decides (True -> "group", False -> "none"). Zero-variance groups give exactly 0 in every mode.
    Options it does not use are ignored (see ``registry.AdvantageEstimator``).
    """
    if scale_rewards is None:
        scale_rewards = "group" if use_std_normalization else "none"
    return _group_centered(raw_rewards, group_size, advantage_eps, scale_rewards)


@register_advantage_estimator("rloo")
def rloo_advantages(raw_rewards: torch.Tensor, group_size: int, **_: Any) -> torch.Tensor:
    """Registered estimator "rloo": REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics";
    Kool et al. 2019).

    ``A_i = r_i - 1/(G-1) * sum_{j != i} r_j = G/(G-1) * (r_i - mean(group))``: each response's
    baseline is the mean of the other ``G - 1`` rewards of its group, so it is independent of
    ``r_i`` and the estimator unbiased. (N,) -> (N,) float32; zero-variance groups give exactly 0.
    ``group_size`` must be at least 2 (ValueError otherwise).
    """
    if group_size < 2:
        raise ValueError(f"advantage estimator 'rloo' needs group_size >= 2 (leave-one-out baseline), got {group_size}")
    centered = _group_centered(raw_rewards, group_size, 0.0, "none").double()
    return (centered * (group_size / (group_size - 1))).to(torch.float32)


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    raw_rewards: torch.Tensor,
    group_size: int,
    *,
    advantage_eps: float = 1e-6,
    group_baseline: bool = False,
    **_: Any,
) -> torch.Tensor:
    """Registered estimator "reinforce_plus_plus": REINFORCE++ (Hu 2025, arXiv:2501.03262) for an
    outcome reward, i.e. batch-normalised returns: ``A = (r - mean_batch(r)) / (std_batch(r) + eps)``.

    ``group_baseline=True`` is REINFORCE++-baseline: ``A' = r - mean(group)`` first, then
    ``A = A' / (std_batch(A') + eps)``, the std taken over the batch's group-centred rewards (their
    batch mean is already 0). Zero-variance groups then give exactly 0; without the group baseline
    only a batch whose rewards are all equal does. Stds are Bessel's (``torch.std``); ``eps`` is
    ``advantage_eps``. The KL-in-reward term of the paper is not part of this estimator.
    (N,) -> (N,) float32.
    """
    rewards = raw_rewards.double().reshape(-1)
    if group_size <= 0 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of group_size={group_size}")
    if group_baseline:
        rewards = _group_centered(raw_rewards, group_size, 0.0, "none").double()
    if rewards.numel() == 0 or bool(rewards.amax() == rewards.amin()):
        return torch.zeros_like(rewards, dtype=torch.float32)
    centered = rewards if group_baseline else rewards - rewards.mean()
    return (centered / (_std_or_zero(rewards) + advantage_eps)).to(torch.float32)


def compute_advantages(estimator: str, raw_rewards: torch.Tensor, group_size: int, **options: Any) -> torch.Tensor:
    """Advantages from the registered ``estimator`` ("grpo", "rloo", "reinforce_plus_plus", ...):
    (N,) rewards -> (N,) or (N, seq).

    ``options`` are the estimator's keywords, e.g. ``advantage_eps``, ``use_std_normalization`` and
    ``scale_rewards`` for "grpo", ``group_baseline`` for "reinforce_plus_plus"; each estimator
    ignores the ones it does not use. Unknown names raise ValueError listing the registered ones.
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
