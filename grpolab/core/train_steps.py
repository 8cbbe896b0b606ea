"""Micro-batch train steps (CS336 A5 §4.2 and §7.2): loss, aggregation, scaling, one backward.

Aggregation modes (``length_normalization``), all invariant to how an optimizer batch is split
into micro-batches (the gradient of accumulated micro-batches equals the big-batch gradient):

- ``"masked_mean"``: mean over each sequence's response tokens, then the mean over sequences
  (CS336 / the original GRPO; a long response's tokens weigh less).
- ``"masked_normalize"``: each sequence's masked token *sum* divided by ``normalize_constant``,
  then the mean over sequences (Dr. GRPO, Liu et al. 2025; the constant is usually the max
  generation length).
- ``"token_mean"``: the masked token sum of the whole optimizer batch over its total response-token
  count (DAPO token-level loss, Yu et al. 2025); pass that total as ``global_num_tokens``.

Scaling: sequence modes divide the micro-batch mean by ``gradient_accumulation_steps``, exactly as
CS336 does. When micro-batches vary in size (dynamic batching by a token budget), pass
``global_batch_size`` (sequences in the optimizer batch) instead: the micro-batch *sum* is then
divided by it, which gives the same gradient as equal micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch

from .kl import check_kl_loss_estimator, kl_estimator
from .losses import compute_policy_gradient_loss, entropy_bonus_loss
from .masking import masked_mean, masked_normalize

LENGTH_NORMALIZATIONS = ("masked_mean", "masked_normalize", "token_mean")


def aggregate_token_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    length_normalization: str = "masked_mean",
    normalize_constant: float | None = None,
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to the scaled 0-d micro-batch loss (see module docstring)."""
    if length_normalization == "token_mean":
        total = masked_normalize(per_token_loss, response_mask, 1.0)
        if global_num_tokens is not None:
            return total / global_num_tokens
        return total / response_mask.sum().clamp(min=1) / gradient_accumulation_steps
    if length_normalization == "masked_mean":
        per_seq = masked_mean(per_token_loss, response_mask, dim=-1)
    elif length_normalization == "masked_normalize":
        if normalize_constant is None:
            raise ValueError("length_normalization='masked_normalize' requires normalize_constant")
        per_seq = masked_normalize(per_token_loss, response_mask, normalize_constant, dim=-1)
    else:
        raise ValueError(
            f"unknown length_normalization {length_normalization!r}; expected one of {', '.join(LENGTH_NORMALIZATIONS)}"
        )
    if global_batch_size is not None:
        return per_seq.sum() / global_batch_size
    return per_seq.mean() / gradient_accumulation_steps


def sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
    *,
    global_batch_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SFT (maximum likelihood) micro-batch step (CS336 A5 ``sft_microbatch_train_step``).

    loss = mean over the batch of ``masked_normalize(-log_probs, mask, normalize_constant, dim=-1)``
    divided by ``gradient_accumulation_steps``; ``loss.backward()`` is called once (gradients
    accumulate into existing ``.grad``). Returns ``(loss, metadata)``.
    """
    loss = aggregate_token_loss(
        -policy_log_probs,
        response_mask,
        gradient_accumulation_steps,
        "masked_normalize",
        normalize_constant=normalize_constant,
        global_batch_size=global_batch_size,
    )
    loss.backward()
    n_tokens = response_mask.sum()
    nll = masked_normalize(-policy_log_probs.detach(), response_mask, 1.0) / n_tokens.clamp(min=1)
    return loss.detach(), {"num_response_tokens": n_tokens, "token_nll": nll}


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    *,
    cliprange_high: float | None = None,
    length_normalization: str = "masked_mean",
    normalize_constant: float | None = None,
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator_name: str = "k3",
    is_weights: torch.Tensor | None = None,
    token_entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    loss_options: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient micro-batch step (CS336 A5 ``grpo_microbatch_train_step``).

    With the defaults: per-token loss from ``compute_policy_gradient_loss`` -> ``masked_mean`` over
    each sequence's tokens -> mean over the batch -> divided by ``gradient_accumulation_steps`` ->
    ``backward()`` once. Keyword-only extras, all applied per token before aggregation:

    - ``loss_options``: the loss's extra keywords (``dual_clip_c``, ``cispo_low``, ``sapo_tau_pos``, ...);
      the loss always gets ``response_mask`` too.
    - ``is_weights`` (batch, seq, detached): sampler/trainer IS weights (``importance_sampling_weights``)
      on the policy-gradient term only (not on the KL or entropy terms).
    - ``ref_log_probs`` with ``kl_coef``: a per-token KL penalty ``kl_coef * k(pi, pi_ref)`` (GRPO
      paper eq. 3). The estimator must be one of ``KL_LOSS_ESTIMATORS`` when ``kl_coef > 0`` (k1 as
      a loss has zero expected gradient: ValueError); with ``kl_coef == 0`` it is only measured
      (metadata ``kl``).
    - ``token_entropy`` (batch, seq) with ``entropy_coef``: the bonus ``-entropy_coef * H`` per token
      (``entropy_bonus_loss``); the gradient flows through ``token_entropy``. Its masked mean is
      reported as metadata ``entropy`` whenever ``token_entropy`` is given.

    Length normalisations: module docstring. Shapes: log-probs, mask (batch, seq); advantages
    (batch,) or (batch, 1). Returns ``(scaled loss, metadata)``.
    """
    if ref_log_probs is not None and kl_coef > 0:
        check_kl_loss_estimator(kl_estimator_name)
    options = {**(loss_options or {}), "response_mask": response_mask}
    per_token, meta = compute_policy_gradient_loss(policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs,
                                                   cliprange, cliprange_high=cliprange_high, **options)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    per_token, metadata = _add_regularisers(
        per_token, policy_log_probs, response_mask, ref_log_probs, kl_coef, kl_estimator_name,
        token_entropy, entropy_coef,
    )
    loss = aggregate_token_loss(per_token, response_mask, gradient_accumulation_steps, length_normalization,
                                normalize_constant, global_num_tokens, global_batch_size)
    loss.backward()
    return loss.detach(), {**metadata, **_loss_metadata(meta, response_mask)}


def _add_regularisers(
    per_token: torch.Tensor,
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    kl_coef: float,
    kl_estimator_name: str,
    token_entropy: torch.Tensor | None,
    entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token KL penalty and entropy bonus added to ``per_token``; their masked means as metadata."""
    metadata: dict[str, torch.Tensor] = {}
    if ref_log_probs is not None:
        kl = kl_estimator(kl_estimator_name)(policy_log_probs, ref_log_probs)
        per_token = per_token + kl_coef * kl if kl_coef else per_token
        metadata["kl"] = masked_mean(kl.detach(), response_mask)
    if token_entropy is not None:
        if entropy_coef:
            per_token = per_token + entropy_bonus_loss(token_entropy, entropy_coef).to(per_token.dtype)
        metadata["entropy"] = masked_mean(token_entropy.detach(), response_mask)
    return per_token, metadata


def _loss_metadata(meta: dict[str, torch.Tensor], response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Clip fraction and mean ratio over the response tokens, and the per-token clip flags and
    ratios, when the loss reports them."""
    out: dict[str, torch.Tensor] = {}
    if "clipped" in meta:
        out["clip_fraction"] = masked_mean(meta["clipped"].float(), response_mask)
        out["clipped"] = meta["clipped"]
    if "dual_clipped" in meta:
        out["dual_clip_fraction"] = masked_mean(meta["dual_clipped"].float(), response_mask)
    if "ratio" in meta:
        out["ratio_mean"] = masked_mean(meta["ratio"], response_mask)
        out["ratio"] = meta["ratio"]  # per token, as the loss weighed it (GSPO: its sequence ratio)
    out["num_response_tokens"] = response_mask.sum()
    return out
