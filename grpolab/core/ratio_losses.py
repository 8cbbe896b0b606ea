"""Importance-ratio policy losses beyond CS336: GSPO, CISPO and SAPO, registered by name.

Each is a pure per-token loss with the registry's signature (``registry.PolicyLoss``), so
``loss_type="gspo" | "cispo" | "sapo"`` reaches it through ``compute_policy_gradient_loss`` and
``grpo_microbatch_train_step`` (whose ``loss_options`` carry the extra knobs below). Shapes: log-probs
and ``response_mask`` (batch, seq); advantages (batch,), (batch, 1) or per token (batch, seq).

| loss_type | ratio | trust region | options |
|---|---|---|---|
| ``gspo`` | per sequence, length-normalised | hard clip of the sequence ratio | (``cliprange``, ``cliprange_high``) |
| ``cispo`` | per token, stop-gradient weight | clip of the weight, gradient kept | ``cispo_low`` |
| ``sapo`` | per token | soft sigmoid gate | ``sapo_tau_pos``, ``sapo_tau_neg`` |
"""

from __future__ import annotations

import torch

from .masking import as_column, required
from .registry import register_policy_loss


def _sequence_mean_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(batch, seq) -> (batch, 1): mean of ``log_ratio`` over each response's tokens (0 if empty).

    Masked-out entries never contribute, even when they hold NaN or inf.
    """
    mask = response_mask.bool()
    total = torch.where(mask, log_ratio, torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)).sum(-1)
    count = mask.sum(-1).clamp(min=1).to(log_ratio.dtype)
    return (total / count).unsqueeze(-1)


def compute_gspo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    *,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO per-token loss (Zheng et al. 2025, "Group Sequence Policy Optimization").

    The importance ratio is the sequence's length-normalised likelihood ratio
    ``s_i = (pi(y_i|x) / pi_old(y_i|x)) ** (1/|y_i|) = exp(1/|y_i| * sum_t (log pi - log pi_old))``
    (the mean over the response's tokens, ``response_mask``), clipped at sequence level:
    ``J = 1/G sum_i min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)`` with
    ``eps_low = cliprange``, ``eps_high = cliprange_high`` (default ``cliprange``). The paper's
    ranges are tiny because ``s_i`` is a per-token geometric mean: 3e-4 (low) and 4e-4 (high).

    Written in the paper's GSPO-token form: ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` has the
    value ``s_i`` at every token and gradient ``s_i * grad log pi(y_t)``, so the per-token loss
    ``-min(s_{i,t} A, clip(s_{i,t}) A)`` equals the sequence loss at every response token and, under
    any aggregation that weighs a sequence's tokens equally (``masked_mean``: ``1/|y_i|``), its
    gradient is GSPO's ``A_i * grad s_i = A_i * s_i * mean_t grad log pi(y_t)``, zero where the
    clip is active. Per-token advantages (batch, seq) give GSPO-token's ``A_{i,t}``.

    Returns ``(loss (batch, seq), {"clipped": bool (batch, seq), "ratio": s_i broadcast, detached})``.
    """
    eps_high = cliprange if cliprange_high is None else cliprange_high
    adv = as_column(advantages).to(policy_log_probs.dtype)
    seq_log_ratio = _sequence_mean_log_ratio(policy_log_probs - old_log_probs, response_mask)
    # value s_i at every token; the gradient reaches each token's log-prob with weight s_i
    ratio = torch.exp(seq_log_ratio.detach() + policy_log_probs - policy_log_probs.detach())
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, {"clipped": clipped < unclipped, "ratio": ratio.detach()}


def compute_cispo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange_high: float,
    *,
    cliprange_low: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO per-token loss (MiniMax 2025, "MiniMax-M1", the CISPO objective): clip the IS weight, keep the gradient.

    ``loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi(y_t)`` with
    ``r_t = pi(y_t) / pi_old(y_t)``. Unlike PPO's clip, no token's gradient is dropped: a token whose
    ratio leaves the range still contributes ``A * grad log pi``, only with a bounded weight.
    ``cliprange_low=None`` means no lower bound (MiniMax sets eps_low large; the weight is then
    ``min(r_t, 1 + eps_high)``). MiniMax normalises by the batch's token count
    (``length_normalization="token_mean"``).

    Returns ``(loss (batch, seq), {"clipped": bool (batch, seq) where the weight was clipped,
    "ratio": r_t detached})``.
    """
    adv = as_column(advantages).to(policy_log_probs.dtype)
    ratio = torch.exp(policy_log_probs - old_log_probs).detach()
    upper = 1.0 + cliprange_high
    lower = None if cliprange_low is None else 1.0 - cliprange_low
    weight = torch.clamp(ratio, min=lower, max=upper)
    clipped = ratio > upper
    if lower is not None:
        clipped = clipped | (ratio < lower)
    return -weight * adv * policy_log_probs, {"clipped": clipped, "ratio": ratio}


def compute_sapo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO per-token loss (Gao et al. 2025, "Soft Adaptive Policy Optimization", Qwen,
    arXiv:2511.20347): a soft, sigmoid-gated trust region in place of the hard clip.

    ``loss_t = -f(r_t) * A`` with ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau``, ``r_t = pi / pi_old``
    and ``tau = tau_pos`` where ``A > 0``, ``tau_neg`` otherwise (the paper's defaults 1.0 and 1.05:
    negative-advantage tokens, whose gradient spreads over many unsampled tokens, decay faster).
    ``df/dr = 4 * sigmoid(tau (r - 1)) * (1 - sigmoid(tau (r - 1)))``: 1 at ``r = 1`` (the on-policy
    gradient equals the unclipped surrogate's) and decaying smoothly as ``r`` leaves 1, so
    ``grad loss_t = -A * df/dr * r_t * grad log pi(y_t)``. The value ``-2A/tau`` at ``r = 1`` is a
    constant offset and carries no gradient.

    Returns ``(loss (batch, seq), {"ratio": r_t detached})``.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo temperatures must be > 0, got tau_pos={tau_pos!r}, tau_neg={tau_neg!r}")
    adv = as_column(advantages).to(policy_log_probs.dtype)
    ratio = torch.exp(policy_log_probs - old_log_probs)
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(policy_log_probs.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -gate * adv, {"ratio": ratio.detach()}


@register_policy_loss("gspo")
def _gspo_loss(policy_log_probs, *, advantages=None, old_log_probs=None, cliprange=None, cliprange_high=None,
               response_mask=None, **_):
    """``gspo``: ``compute_gspo_loss`` (sequence-level ratio; needs ``response_mask`` and ``cliprange``)."""
    return compute_gspo_loss(
        required("gspo", "advantages", advantages),
        policy_log_probs,
        required("gspo", "old_log_probs", old_log_probs),
        required("gspo", "response_mask", response_mask),
        required("gspo", "cliprange", cliprange),
        cliprange_high=cliprange_high,
    )


@register_policy_loss("cispo")
def _cispo_loss(policy_log_probs, *, advantages=None, old_log_probs=None, cliprange=None, cliprange_high=None,
                cispo_low=None, **_):
    """``cispo``: ``compute_cispo_loss``; upper bound ``1 + cliprange_high`` (else ``1 + cliprange``),
    lower bound ``1 - cispo_low`` (option; None = no lower bound, MiniMax's choice)."""
    upper = cliprange if cliprange_high is None else cliprange_high
    return compute_cispo_loss(
        required("cispo", "advantages", advantages),
        policy_log_probs,
        required("cispo", "old_log_probs", old_log_probs),
        required("cispo", "cliprange_high or cliprange", upper),
        cliprange_low=cispo_low,
    )


@register_policy_loss("sapo")
def _sapo_loss(policy_log_probs, *, advantages=None, old_log_probs=None, sapo_tau_pos=1.0, sapo_tau_neg=1.05, **_):
    """``sapo``: ``compute_sapo_loss`` with the options ``sapo_tau_pos`` (1.0) and ``sapo_tau_neg`` (1.05)."""
    return compute_sapo_loss(
        required("sapo", "advantages", advantages),
        policy_log_probs,
        required("sapo", "old_log_probs", old_log_probs),
        tau_pos=sapo_tau_pos,
        tau_neg=sapo_tau_neg,
    )
