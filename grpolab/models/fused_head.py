"""The output head, chunked: per-token log-probs and entropies of a causal LM without its
(batch, seq, vocab) logits (the memory note of ``core.logprobs``).

- for the Llama-family models of ``CHUNKED_HEAD_MODEL_TYPES`` the model's own forward runs as
  usual (engines and hooks see an ordinary call) while its output head is swapped, for that one
  call, for a chunked head that returns each position's log-prob and entropy instead of its logits;
  a plain float head is fused (``_FusedHeadStats``: its backward rebuilds each chunk's logits into
  their gradient in place), any other head is checkpointed chunk by chunk;
- for any other model the logits come from its forward and only the log-softmax is chunked.

``response_log_probs`` is what the trainers, evaluation and the shared-prefix forward call; it
equals ``core.get_response_log_probs``, the plain CS336 reference, in values and gradients.
``response_divergence`` scores a student against a teacher with a full-vocabulary divergence
(``core.divergences``) at the response positions, the logits of both a chunk at a time.
``unwrap_model`` finds the Hugging Face model inside DDP, DeepSpeed and LoRA wrappers.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from ..core import get_divergence
from ..core.logprobs import (
    check_temperature,
    chunked_token_stats,
    log_probs_from_logits,
    logits_chunk_tokens,
    tokenize_prompt_and_output,
)

# models whose forward is `logits = lm_head(last hidden state)` with nothing after it (no soft-capping
# or logit scaling): their head can be chunked inside the forward. Others fall back to chunking the
# log-softmax of the logits their forward returns.
CHUNKED_HEAD_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_POST_HEAD_CONFIG = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def unwrap_model(model: Any) -> Any:
    """The Hugging Face model inside engine and adapter wrappers: DDP and DeepSpeed (``.module``),
    a LoRA model with its adapter disabled (``._policy``). A peft model answers for its base."""
    for _ in range(8):
        inner = getattr(model, "module", None)
        if inner is None:
            inner = getattr(model, "_policy", None)
        if inner is None or not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def output_head(model: Any) -> torch.nn.Module | None:
    """The output projection (``lm_head``) of a model whose forward ends with it, or None when
    the model is not one of ``CHUNKED_HEAD_MODEL_TYPES`` (or its config scales or caps the logits
    after the head): those are scored from the logits their forward returns."""
    inner = unwrap_model(model)
    cfg = getattr(inner, "config", None)
    if getattr(cfg, "model_type", None) not in CHUNKED_HEAD_MODEL_TYPES:
        return None
    if any(getattr(cfg, name, None) not in (None, 1, 1.0) for name in _POST_HEAD_CONFIG):
        return None
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


class _FusedHeadStats(torch.autograd.Function):
    """Log-probs of ``labels`` and entropies under softmax((hidden @ weight.T + bias) / T), a chunk of
    positions at a time, keeping only (N,) figures between forward and backward: the backward
    recomputes each chunk's logits and turns them into their gradient in place,
    d log p_y / dz = onehot(y) - p and dH / dz = -p * (log p + H) (over T). The same values and
    gradients as the checkpointed path below with fewer passes over the (chunk, vocab) block."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, step, want_entropy):
        n, acc = hidden.shape[0], torch.promote_types(weight.dtype, torch.float32)
        log_probs = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_zeros(n, dtype=acc)
        lse_all = hidden.new_empty(n, dtype=acc)
        for i in range(0, n, step):
            z = torch.nn.functional.linear(hidden[i : i + step], weight, bias).to(acc)
            if temperature != 1.0:
                z.div_(temperature)
            lse = torch.logsumexp(z, dim=-1)
            lse_all[i : i + step] = lse
            log_probs[i : i + step] = z.gather(-1, labels[i : i + step, None]).squeeze(-1) - lse
            if want_entropy:
                logp = z.sub_(lse[:, None])
                entropy[i : i + step] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse_all, entropy)
        ctx.temperature, ctx.step = temperature, step
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, bias, labels, lse_all, entropy = ctx.saved_tensors
        t, step, acc = ctx.temperature, ctx.step, lse_all.dtype
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if bias is not None and ctx.needs_input_grad[2] else None
        if grad_lp is None:
            grad_lp = torch.zeros_like(lse_all)
        for i in range(0, hidden.shape[0], step):
            h = hidden[i : i + step]
            z = torch.nn.functional.linear(h, weight, bias).to(acc)
            if t != 1.0:
                z.div_(t)
            logp = z.sub_(lse_all[i : i + step, None])
            g = grad_lp[i : i + step, None]
            if grad_ent is not None and bool(grad_ent[i : i + step].any()):
                p = logp.exp()
                # -p * (g_lp + g_H * (log p + H)), then + g_lp at the label
                grad = logp.add_(entropy[i : i + step, None]).mul_(grad_ent[i : i + step, None]).add_(g).mul_(p).neg_()
            else:
                grad = logp.exp_().mul_(-g)
            grad.scatter_add_(-1, labels[i : i + step, None], g)
            if t != 1.0:
                grad.div_(t)
            if grad_hidden is not None:
                grad_hidden[i : i + step] = grad.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), h.to(acc))
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _fusable(head, inner) -> bool:
    """A plain ``nn.Linear`` head called through its own forward (no float32 wrapper, no hooks, no
    autocast on the head's device), with ordinary float32/float64 weights: also FSDP2's, which are
    plain unsharded tensors during the forward and stay so until its backward. Anything else (the
    float32 head under bf16, ZeRO-3's partitions, a hooked head) takes the checkpointed path, whose
    recomputation goes through the head's own forward."""
    if type(head) is not torch.nn.Linear or getattr(inner, "__func__", None) is not torch.nn.Linear.forward:
        return False
    weight = head.weight
    if head._forward_hooks or head._forward_pre_hooks or torch.is_autocast_enabled(weight.device.type):
        return False
    return type(weight) is torch.nn.Parameter and type(weight.data) is torch.Tensor and \
        weight.dtype in (torch.float32, torch.float64) and not hasattr(weight, "ds_id")


class _ChunkedHead:
    """For one forward call, ``head`` returns (batch, seq, 2) = (log-prob of ``labels``, entropy)
    (or (batch, seq, 1) without entropy) computed over chunks of positions, instead of the
    (batch, seq, vocab) logits. The head's own forward (or an instance-level wrapper of it, such
    as ``models.precision``'s float32 head) computes each chunk's logits."""

    def __init__(self, head, labels, want_entropy: bool, temperature: float, chunk_tokens: int | None,
                 keep_hidden: bool, vocab_size: int | None, positions: torch.Tensor | None = None):
        self.head, self.labels, self.want_entropy, self.positions = head, labels, want_entropy, positions
        self.temperature, self.keep_hidden = temperature, keep_hidden
        vocab = getattr(head, "out_features", None) or vocab_size or 1
        self.step = logits_chunk_tokens(vocab, chunk_tokens)
        self.used, self.hidden = False, None

    def __enter__(self):
        self.previous = self.head.__dict__.get("forward")
        self.inner = self.head.forward  # the instance wrapper if any, else the class's forward
        self.head.forward = self._forward
        return self

    def __exit__(self, *exc):
        if self.previous is None:
            del self.head.forward
        else:
            self.head.forward = self.previous
        return False

    def _forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.used or args or kwargs or tuple(hidden.shape[:-1]) != tuple(self.labels.shape):
            return self.inner(hidden, *args, **kwargs)  # not the call we expected: plain logits
        self.used = True
        if self.keep_hidden:
            self.hidden = hidden
        needs_grad = torch.is_grad_enabled() and (
            hidden.requires_grad or any(p.requires_grad for p in self.head.parameters()))
        rows, labels = hidden.reshape(-1, hidden.shape[-1]), self.labels.reshape(-1)
        if self.positions is not None:  # the head at those positions only (a differentiable gather)
            keep = self.positions.reshape(-1).nonzero().squeeze(-1)
            rows, labels = rows.index_select(0, keep), labels.index_select(0, keep)
        if needs_grad and _fusable(self.head, self.inner):
            log_probs, entropy = _FusedHeadStats.apply(rows, self.head.weight, self.head.bias, labels,
                                                       self.temperature, self.step, self.want_entropy)
        else:
            log_probs, entropy = chunked_token_stats(rows, labels, self.inner, self.want_entropy, self.temperature,
                                                     self.step, owned=True, needs_grad=needs_grad)
        packed = torch.stack([log_probs, entropy], -1) if self.want_entropy else log_probs.unsqueeze(-1)
        if self.positions is not None:  # zeros elsewhere
            packed = packed.new_zeros(self.labels.numel(), packed.shape[-1]).index_copy(0, keep, packed)
        return packed.view(*self.labels.shape, packed.shape[-1])


def log_probs_from_forward(
    model: Any,
    labels: torch.Tensor,
    forward: Callable[..., Any],
    return_token_entropy: bool = False,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    return_last_hidden: bool = False,
    positions: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Log-probs of ``labels`` (batch, seq) under softmax(logits / ``temperature``) of the forward
    ``forward(**extra)`` of ``model`` (a closure calling the model, or its engine wrapper, on the
    inputs whose logits line up with ``labels``), without the (batch, seq, vocab) logits: see the
    module doc. Returns ``log_probs``, ``token_entropy`` when asked, and ``last_hidden_state`` (the
    head's input, (batch, seq, hidden)) when asked. ``positions`` (bool, the labels' shape): the
    figures are 0 elsewhere; a chunkable head runs at those positions only (no padding or prompt
    position through the (rows, vocab) head, forward or backward)."""
    temperature = check_temperature(temperature)
    head = output_head(model)
    out: dict[str, torch.Tensor] = {}
    if head is not None:
        cfg = getattr(unwrap_model(model), "config", None)
        with _ChunkedHead(head, labels, return_token_entropy, temperature, chunk_tokens, return_last_hidden,
                          getattr(cfg, "vocab_size", None), positions) as chunked:
            result = forward()
        if chunked.used:
            packed = result.logits
            out["log_probs"] = packed[..., 0]
            if return_token_entropy:
                out["token_entropy"] = packed[..., 1]
            if return_last_hidden:
                out["last_hidden_state"] = chunked.hidden
            return out
        if return_last_hidden:
            raise RuntimeError("the model's forward did not call its output head on the labels' positions")
    else:
        result = forward(**({"output_hidden_states": True} if return_last_hidden else {}))
        if return_last_hidden:
            out["last_hidden_state"] = result.hidden_states[-1]
    log_probs, entropy = log_probs_from_logits(result.logits, labels, return_token_entropy, temperature=temperature,
                                               chunk_tokens=chunk_tokens)
    if positions is not None:  # the same figures as the chunked head's: 0 elsewhere
        log_probs = log_probs.masked_fill(~positions, 0.0)
        entropy = entropy.masked_fill(~positions, 0.0) if return_token_entropy else entropy
    out["log_probs"] = log_probs
    if return_token_entropy:
        out["token_entropy"] = entropy
    return out


def response_log_probs(
    model: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    return_last_hidden: bool = False,
    positions: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``core.get_response_log_probs`` (CS336 A5) without the (batch, seq, vocab) logits: the same
    values and gradients, from the chunked output head of ``log_probs_from_forward``.

    Returns ``{"log_probs": (batch, seq)}`` and, when asked, ``"token_entropy": (batch, seq)``, both
    of ``softmax(logits / temperature)`` (keyword-only, > 0; pass the sampling temperature so the
    log-probs in ratios and KLs are of the distribution that drew the tokens). No masking and no
    ``no_grad`` here: the caller decides. ``attention_mask`` (keyword-only, optional) is passed to
    the model; right-padded batches do not need it for the non-pad positions.

    The logits are never whole: at most ``chunk_tokens`` positions of them at a time (default: one
    ``LOGITS_CHUNK_BYTES`` float32 block), with the same values and gradients as the unchunked
    computation (``log_probs_from_forward``). ``return_last_hidden`` adds ``"last_hidden_state"``
    (batch, seq, hidden), the output head's input (PPO's value head reads it). ``positions`` (bool,
    the labels' shape, e.g. the response mask): the head runs there only, 0 elsewhere.
    """
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    return log_probs_from_forward(model, labels, lambda **extra: model(input_ids, **kwargs, **extra),
                                  return_token_entropy, temperature=temperature, chunk_tokens=chunk_tokens,
                                  return_last_hidden=return_last_hidden, positions=positions)


def sum_response_log_probs(
    model: Any,
    tokenizer: Any,
    prompt_strs: list[str],
    output_strs: list[str],
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example sum of the output tokens' log-probs given the prompt under
    ``softmax(logits / temperature)``, and the output token counts: ``(sums (batch,), counts
    (batch,))``. Gradients flow unless the caller disables them."""
    batch = tokenize_prompt_and_output(prompt_strs, output_strs, tokenizer)
    device = next(model.parameters()).device
    mask = batch["response_mask"].to(device)
    input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    lp = response_log_probs(model, input_ids, labels, temperature=temperature)["log_probs"]
    return (lp * mask).sum(-1), mask.sum(-1)


def _vocab_size(model: Any, head: torch.nn.Module | None) -> int | None:
    size = getattr(head, "out_features", None)
    return size if size is not None else getattr(getattr(unwrap_model(model), "config", None), "vocab_size", None)


def _divergence_inputs(model, input_ids, labels, mask, kwargs, temperature, chunk_tokens):
    """One forward of ``model``: (log-probs (batch, seq), the masked positions' head input (N, D),
    the map from those rows to their logits). With a chunkable head the rows are the last hidden
    states and the map is the head; otherwise the rows are the logits the forward returns."""
    head = output_head(model)
    if head is not None:
        out = response_log_probs(model, input_ids, labels, attention_mask=kwargs.get("attention_mask"),
                                 temperature=temperature, chunk_tokens=chunk_tokens, return_last_hidden=True)
        return out["log_probs"], out["last_hidden_state"][mask], head
    logits = model(input_ids, **kwargs).logits
    log_probs, _ = log_probs_from_logits(logits, labels, temperature=temperature, chunk_tokens=chunk_tokens)
    return log_probs, logits[mask], lambda rows: rows


def response_divergence(
    student: Any,
    teacher: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    name: str,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The registered divergence ``name`` (``core.get_divergence``: ``forward_kl``, ``reverse_kl``,
    ``generalized_jsd`` with ``beta``) between the student's and the teacher's next-token
    distributions, ``softmax(logits / temperature)``, at every position where ``mask`` (batch, seq,
    bool) is True.

    Returns ``"divergence"`` (N,), one value per True of ``mask`` in the row-major order of
    ``mask.nonzero()``, and ``"student_log_probs"`` / ``"teacher_log_probs"``, the (batch, seq)
    log-probs of ``labels`` under each model (at the same temperature). One forward per model (the
    teacher's under ``no_grad``; modes are left as they are); gradients reach the student only.
    For a model with a chunkable head (``output_head``) its (batch, seq, vocab) logits never exist:
    the masked positions' last hidden states go through the head ``chunk_tokens`` rows at a time
    (``logits_chunk_tokens``), each chunk checkpointed when gradients flow, so one chunk's logits
    of each model live at a time in the forward and in the backward. Another model's logits come
    from its forward, and only the divergence is chunked. The two may be different classes but must
    share the vocabulary size (ValueError).
    """
    divergence = get_divergence(name)
    temperature = check_temperature(temperature)
    if mask.dtype != torch.bool or tuple(mask.shape) != tuple(labels.shape):
        raise ValueError(f"mask must be bool with the labels' shape {tuple(labels.shape)}, got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    sizes = (_vocab_size(student, output_head(student)), _vocab_size(teacher, output_head(teacher)))
    if None not in sizes and sizes[0] != sizes[1]:
        raise ValueError(f"student and teacher vocabularies differ: student {sizes[0]}, teacher {sizes[1]}")
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    s_log_probs, s_rows, s_logits = _divergence_inputs(student, input_ids, labels, mask, kwargs, temperature,
                                                       chunk_tokens)
    with torch.no_grad():
        t_log_probs, t_rows, t_logits = _divergence_inputs(teacher, input_ids, labels, mask, kwargs, temperature,
                                                           chunk_tokens)

    def chunk(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        z_s = s_logits(s)
        with torch.no_grad():
            z_t = t_logits(t)
        return divergence(z_s, z_t, temperature=temperature, beta=beta)

    step = logits_chunk_tokens(sizes[0] or sizes[1] or s_rows.shape[-1], chunk_tokens)
    head_params = s_logits.parameters() if isinstance(s_logits, torch.nn.Module) else ()
    needs_grad = torch.is_grad_enabled() and (s_rows.requires_grad or any(p.requires_grad for p in head_params))
    n = s_rows.shape[0]
    if n <= step:
        values = chunk(s_rows, t_rows)
    else:
        parts = [(checkpoint(chunk, s_rows[i : i + step], t_rows[i : i + step], use_reentrant=False) if needs_grad
                  else chunk(s_rows[i : i + step], t_rows[i : i + step])) for i in range(0, n, step)]
        values = torch.cat(parts)
    return {"divergence": values, "student_log_probs": s_log_probs, "teacher_log_probs": t_log_probs}
