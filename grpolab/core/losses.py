"""Per-token policy-gradient losses (CS336 A5 §7.2), PPO value loss, DPO loss.

The policy-gradient losses are registered by name (``registry.register_policy_loss``);
``compute_policy_gradient_loss`` dispatches on ``loss_type`` through that registry.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .masking import as_column, required
from .registry import get_policy_loss, register_policy_loss

# The CS336 loss types, registered below in this order. New losses register themselves, so
# validators should use ``policy_loss_names()``, which starts with these four.
LOSS_TYPES = ("no_baseline", "reinforce_with_baseline", "grpo_clip", "grpo_no_clip")


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    """REINFORCE per-token loss ``-A * log pi(o_t)`` (Williams 1992; CS336 A5), A broadcast (B,1)->(B,T)."""
    return -as_column(raw_rewards_or_advantages).to(policy_log_probs.dtype) * policy_log_probs


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
    *,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate per token (Schulman et al. 2017 eq. 7; Shao et al. 2024 eq. 3).

    ``ratio = exp(new - old)``; ``loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``
    with ``eps_low = cliprange_low`` and ``eps_high = cliprange_high`` when given (DAPO's
    asymmetric "clip-higher", Yu et al. 2025), else ``cliprange``.

    ``dual_clip_c`` (> 1, e.g. 3.0; None = off): PPO dual-clip (Ye et al. 2020, "Mastering Complex
    Control in MOBA Games with Deep RL"). Where ``A < 0`` the loss is capped at ``-c * A``:
    ``min(max(-ratio * A, -clip(ratio) * A), -c * A)``, so a token whose ratio has run far above
    ``c`` contributes a bounded loss and no gradient; ``A >= 0`` is unchanged.

    Metadata: ``clipped`` (bool, (batch, seq): the token's gradient is cut, i.e. the clipped term is
    the smaller one, or the dual clip is active), ``dual_clipped`` (bool, only with ``dual_clip_c``)
    and ``ratio`` (detached).
    """
    eps_low = cliprange if cliprange_low is None else cliprange_low
    eps_high = cliprange if cliprange_high is None else cliprange_high
    if eps_low is None or eps_high is None:
        raise ValueError("cliprange is required for the clipped loss")
    adv = as_column(advantages).to(policy_log_probs.dtype)
    ratio = torch.exp(policy_log_probs - old_log_probs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    meta = {"clipped": clipped < unclipped, "ratio": ratio.detach()}
    if dual_clip_c is None:
        return loss, meta
    if not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (Ye et al. 2020), got {dual_clip_c!r}")
    cap = -dual_clip_c * adv
    dual = (adv < 0) & (loss > cap)
    loss = torch.where(dual, cap, loss)
    meta["clipped"] = meta["clipped"] | dual
    meta["dual_clipped"] = dual
    return loss, meta


def entropy_bonus_loss(token_entropy: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token entropy bonus ``-coef * H_t`` (batch, seq) to add to a per-token policy loss.

    Minimising ``loss - coef * H`` maximises ``J + coef * H`` (Williams & Peng 1991; Mnih et al.
    2016, A3C's entropy regularisation; Schulman et al. 2017, the ``c2 * S`` term of PPO eq. 9). The
    gradient flows through ``token_entropy`` when it carries one (entropy computed from logits).
    """
    return -coef * token_entropy


@register_policy_loss("no_baseline")
def _no_baseline_loss(policy_log_probs, *, raw_rewards=None, **_):
    """CS336 ``no_baseline``: REINFORCE on the raw reward, ``-R * log pi`` per token."""
    rewards = required("no_baseline", "raw_rewards", raw_rewards)
    return compute_naive_policy_gradient_loss(rewards, policy_log_probs), {}


@register_policy_loss("reinforce_with_baseline")
def _reinforce_with_baseline_loss(policy_log_probs, *, advantages=None, **_):
    """CS336 ``reinforce_with_baseline``: ``-A * log pi`` per token with the group baseline."""
    adv = required("reinforce_with_baseline", "advantages", advantages)
    return compute_naive_policy_gradient_loss(adv, policy_log_probs), {}


@register_policy_loss("grpo_clip")
def _grpo_clip_loss(
    policy_log_probs, *, advantages=None, old_log_probs=None, cliprange=None, cliprange_high=None, dual_clip_c=None, **_
):
    """CS336 ``grpo_clip``: ``compute_grpo_clip_loss`` (DAPO clip-higher via ``cliprange_high``;
    PPO dual-clip via the option ``dual_clip_c``, off when None)."""
    return compute_grpo_clip_loss(
        required("grpo_clip", "advantages", advantages),
        policy_log_probs,
        required("grpo_clip", "old_log_probs", old_log_probs),
        required("grpo_clip", "cliprange", cliprange),
        cliprange_high=cliprange_high,
        dual_clip_c=dual_clip_c,
    )


@register_policy_loss("grpo_no_clip")
def _grpo_no_clip_loss(policy_log_probs, *, advantages=None, old_log_probs=None, **_):
    """CS336 §8 ``grpo_no_clip``: the unclipped importance-weighted loss ``-ratio * A`` per token."""
    adv = as_column(required("grpo_no_clip", "advantages", advantages)).to(policy_log_probs.dtype)
    ratio = torch.exp(policy_log_probs - required("grpo_no_clip", "old_log_probs", old_log_probs))
    return -ratio * adv, {"ratio": ratio.detach()}


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    *,
    cliprange_high: float | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss of the registered ``loss_type`` (CS336 A5 §7.2, plus ``grpo_no_clip`` of §8).

    ``no_baseline`` uses ``raw_rewards``; ``reinforce_with_baseline`` uses ``advantages``;
    ``grpo_clip`` uses ``advantages``, ``old_log_probs`` and ``cliprange`` (``cliprange_high`` for
    DAPO clip-higher); ``grpo_no_clip`` is the unclipped ratio loss ``-ratio * A``. Other names
    come from ``register_policy_loss`` (see ``registry.PolicyLoss`` for the signature);
    ``**options`` are passed on to the loss. Shapes: log-probs (batch, seq), rewards/advantages
    (batch,) or (batch, 1). Returns ``(loss (batch, seq), metadata)``.
    """
    loss_fn = get_policy_loss(loss_type)
    return loss_fn(
        policy_log_probs,
        raw_rewards=raw_rewards,
        advantages=advantages,
        old_log_probs=old_log_probs,
        cliprange=cliprange,
        cliprange_high=cliprange_high,
        **options,
    )


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    cliprange_value: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss per token (Schulman et al. 2017; as in OpenAI baselines / TRL).

    ``0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)``; ``cliprange_value=None``
    gives the plain ``0.5 * (V - R)^2``. Returns ``(loss (B, T), {"clipped": bool (B, T)})``;
    aggregate it with ``masked_mean``.
    """
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        return 0.5 * unclipped, {"clipped": torch.zeros_like(unclipped, dtype=torch.bool)}
    v_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    clipped = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), {"clipped": clipped > unclipped}


def compute_dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """Per-example DPO loss (Rafailov et al. 2023, eq. 7): ``-log sigmoid(beta * ((c - c_ref) - (r - r_ref)))``."""
    logits = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    return -F.logsigmoid(beta * logits)


def compute_bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                               margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-pair reward-model loss (Bradley & Terry 1952; Ouyang et al. 2022, eq. 1), with the
    optional margin of Touvron et al. 2023 (Llama 2, eq. 2): ``-log sigmoid(r_c - r_r - margin)``."""
    return -F.logsigmoid(chosen_rewards.float() - rejected_rewards.float() - margin)
