"""Full-vocabulary divergences between a student's and a teacher's next-token distributions.

On-policy distillation scores the student's own samples with a divergence between the two models'
whole next-token distributions at each position:

- ``forward_kl``: KL(teacher || student), mass-covering (the token-level loss of supervised KD);
- ``reverse_kl``: KL(student || teacher), mode-seeking: the per-token loss of MiniLLM (Gu et al.
  2024, "MiniLLM: Knowledge Distillation of Large Language Models") and of Thinking Machines'
  "On-Policy Distillation" (2025);
- ``generalized_jsd``: the generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024,
  "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"), as
  TRL's ``GKDTrainer.generalized_jsd_loss`` computes it.

Each is registered by name (``core.registry``: ``get_divergence``, ``divergence_names``) with the
``Divergence`` signature: ``fn(student_logits (..., V), teacher_logits (..., V), *, temperature,
beta) -> (...)``, both distributions ``softmax(logits / temperature)``, reduced in float32 at least,
the teacher detached. A term with p_v = 0 contributes 0 (the limit of p log p), so a teacher that
masks tokens with -inf logits gives finite values and gradients wherever the divergence is finite;
a NaN logit gives NaN (the caller checks). ``models.fused_head.response_divergence`` evaluates these
over the response positions of two causal LMs without their (batch, seq, vocab) logits.
"""

from __future__ import annotations

import math

import torch

from .logprobs import check_temperature
from .registry import register_divergence


def _log_probs(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
               temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(z / T) of both, in float32 at least (float64 when either is float64); the
    teacher's without a gradient."""
    t = check_temperature(temperature)
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(f"student and teacher vocabularies differ: {student_logits.shape[-1]} vs "
                         f"{teacher_logits.shape[-1]}")
    dtype = torch.promote_types(torch.promote_types(student_logits.dtype, teacher_logits.dtype), torch.float32)
    log_s = torch.log_softmax(student_logits.to(dtype) / t, dim=-1)
    log_t = torch.log_softmax(teacher_logits.detach().to(dtype) / t, dim=-1)
    return log_s, log_t


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) from log-probs (..., V) -> (...), with 0 where
    p_v = 0. The difference is replaced *before* the product, so no 0 * inf meets the backward
    either; a NaN in log_p is not -inf and propagates."""
    diff = torch.where(torch.isneginf(log_p), 0.0, log_p - log_q)
    return (log_p.exp() * diff).sum(-1)


def _log_mixture(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """log((1 - beta) p_s + beta p_t), 0 < beta < 1, by a two-term log-sum-exp (``logaddexp``: no
    stacked copy). Where both are -inf the inputs are replaced by 0 first: the log-sum-exp's
    backward of two -inf is NaN even under a zero gradient, and no KL term reads the mixture there
    (both p are 0)."""
    both = torch.isneginf(log_s) & torch.isneginf(log_t)
    mixture = torch.logaddexp(torch.where(both, 0.0, log_s) + math.log1p(-beta),
                              torch.where(both, 0.0, log_t) + math.log(beta))
    return torch.where(both, -math.inf, mixture)


@register_divergence("forward_kl")
def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature: float = 1.0,
               beta: float = 0.5) -> torch.Tensor:
    """KL(teacher || student) = sum_v p_t (log p_t - log p_s) per position: (..., V) -> (...).

    Mass-covering: the student is pushed to put mass wherever the teacher does. ``beta`` is ignored.
    +inf where the teacher gives mass to a token the student gives none.
    """
    log_s, log_t = _log_probs(student_logits, teacher_logits, temperature)
    return _kl(log_t, log_s)


@register_divergence("reverse_kl")
def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature: float = 1.0,
               beta: float = 0.5) -> torch.Tensor:
    """KL(student || teacher) = sum_v p_s (log p_s - log p_t) per position: (..., V) -> (...).

    Mode-seeking, the per-token loss of MiniLLM and Thinking Machines' on-policy distillation.
    ``beta`` is ignored. +inf where the student gives mass to a token the teacher masks (-inf).
    """
    log_s, log_t = _log_probs(student_logits, teacher_logits, temperature)
    return _kl(log_s, log_t)


@register_divergence("generalized_jsd")
def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature: float = 1.0,
                    beta: float = 0.5) -> torch.Tensor:
    """GKD's generalised JSD (Agarwal et al. 2024) per position: (..., V) -> (...).

    With M = (1 - beta) p_s + beta p_t: ``beta * KL(p_t || M) + (1 - beta) * KL(p_s || M)``; the
    mixture is formed in log space. beta = 0.5 is the symmetric JSD. TRL's convention at the ends,
    kept here: ``beta == 0`` returns ``forward_kl`` and ``beta == 1`` returns ``reverse_kl`` exactly.
    These are not the formula's limits, which are 0 at both ends (near 0 the value is about
    ``beta * forward_kl``, near 1 about ``(1 - beta) * reverse_kl``): the ends are a choice of loss,
    not a continuation. Finite for 0 < beta < 1 even where the teacher masks tokens (-inf).
    ValueError unless 0 <= beta <= 1.
    """
    if not 0.0 <= beta <= 1.0:  # also rejects NaN
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, temperature=temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, temperature=temperature)
    log_s, log_t = _log_probs(student_logits, teacher_logits, temperature)
    log_m = _log_mixture(log_s, log_t, float(beta))
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)
