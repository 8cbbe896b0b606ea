"""Per-token log-probabilities, entropy and prompt/response tokenisation (CS336 A5 §4.2).

Memory. A real vocabulary makes the logits the largest tensor of a forward: (batch, seq, vocab)
float32 is 6.4 GB for 32 rows of 1024 tokens over 49k tokens, and a log-softmax makes copies of it.
Here log-probs and entropies are computed over chunks of positions, so at most one (chunk, vocab)
block of logits (``LOGITS_CHUNK_BYTES``, float32) and the few temporaries of its log-softmax exist
at a time, however many rows there are:

- for the Llama-family models of ``CHUNKED_HEAD_MODEL_TYPES`` the model's own forward runs as
  usual (engines and hooks see an ordinary call) while its output head is swapped, for that one
  call, for a chunked head that returns each position's log-prob and entropy instead of its logits;
- for any other model the logits come from its forward and only the log-softmax is chunked.

With gradients, each chunk is checkpointed (``torch.utils.checkpoint``): the backward recomputes a
chunk's logits instead of keeping every chunk's, and the gradient equals the unchunked one.
Inference callers also bound the rows of a forward by tokens (``pack_rows``, ``INFERENCE_TOKEN_BUDGET``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

# one (chunk, vocab) float32 logits block at most: 128 MiB is 682 positions of a 49k vocabulary
LOGITS_CHUNK_BYTES = 128 * 2**20
# rows x padded length of one forward in the inference paths (eval entropies, old/reference log-probs)
INFERENCE_TOKEN_BUDGET = 8192
# models whose forward is `logits = lm_head(last hidden state)` with nothing after it (no soft-capping
# or logit scaling): their head can be chunked inside the forward. Others fall back to chunking the
# log-softmax of the logits their forward returns.
CHUNKED_HEAD_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_POST_HEAD_CONFIG = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits are reduced in float32; float32/float64 stay as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy (nats) of the softmax over the last dimension: (..., V) -> (...).

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, which stays finite for large logits.
    """
    logits = _upcast(logits)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return lse - (probs * logits).sum(dim=-1)


def _check_temperature(temperature: float) -> float:
    if not temperature > 0:  # also rejects NaN
        raise ValueError(f"temperature must be > 0, got {temperature!r} (map greedy decoding, T=0, to 1.0)")
    return float(temperature)


def logits_chunk_tokens(vocab_size: int, chunk_tokens: int | None = None) -> int:
    """Positions per logits block: ``chunk_tokens`` when given, else as many as fit one
    ``LOGITS_CHUNK_BYTES`` float32 block of ``vocab_size`` columns."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return int(chunk_tokens)
    return max(1, LOGITS_CHUNK_BYTES // (4 * max(1, int(vocab_size))))


def _token_stats(logits: torch.Tensor, labels: torch.Tensor, want_entropy: bool, temperature: float,
                 owned: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, V) logits, (N,) labels -> (N,) log-probs under softmax(logits / T) and entropies. One
    logsumexp serves both; the (N, V) log-softmax is never materialised. ``owned``: the logits are a
    temporary nobody else reads and no gradient flows, so they may be overwritten (fewer copies; the
    values are the same bit for bit)."""
    inplace = (owned or logits.dtype in (torch.float16, torch.bfloat16)) and not (
        torch.is_grad_enabled() and logits.requires_grad)
    logits = _upcast(logits)
    if temperature != 1.0:
        logits = logits.div_(temperature) if inplace else logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    label_logits = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    log_probs = label_logits - lse
    entropy = None
    if want_entropy:
        probs = (logits - lse.unsqueeze(-1)).exp_()
        entropy = lse - (probs.mul_(logits) if inplace else probs * logits).sum(dim=-1)
    return log_probs, entropy


def _chunked_stats(source: torch.Tensor, labels: torch.Tensor, to_logits: Callable[[torch.Tensor], torch.Tensor],
                   want_entropy: bool, temperature: float, step: int, *, owned: bool,
                   needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_token_stats(to_logits(source[i:i+step]))`` over chunks of ``step`` rows of ``source``
    (N, D). With ``needs_grad`` and more than one chunk each chunk is checkpointed, so only one
    chunk's logits and their autograd state exist at a time, in the forward and in the backward."""
    n = source.shape[0]

    def stats(src: torch.Tensor, lab: torch.Tensor):
        return _token_stats(to_logits(src), lab, want_entropy, temperature, owned)

    if n <= step:
        return stats(source, labels)
    parts = []
    for i in range(0, n, step):
        src, lab = source[i : i + step], labels[i : i + step]
        parts.append(checkpoint(stats, src, lab, use_reentrant=False) if needs_grad else stats(src, lab))
    log_probs = torch.cat([p[0] for p in parts])
    return log_probs, (torch.cat([p[1] for p in parts]) if want_entropy else None)


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``labels`` (batch, seq) under ``softmax(logits / temperature)``, logits
    (batch, seq, vocab), and that distribution's per-position entropy when asked (else None).

    ``temperature`` (> 0) is the sampler's: the policy being optimised is the tempered softmax
    that drew the tokens (as TRL and veRL do). One logsumexp serves both outputs; the
    (batch, seq, vocab) log-softmax is never materialised, and its temporaries exist for one
    chunk of ``chunk_tokens`` positions at a time (default: ``LOGITS_CHUNK_BYTES`` of float32;
    checkpointed when gradients flow). bf16/fp16 logits are reduced in float32.
    """
    temperature = _check_temperature(temperature)
    vocab = logits.shape[-1]
    step = logits_chunk_tokens(vocab, chunk_tokens)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    log_probs, entropy = _chunked_stats(logits.reshape(-1, vocab), labels.reshape(-1), lambda z: z,
                                        return_token_entropy, temperature, step, owned=False, needs_grad=needs_grad)
    log_probs = log_probs.view(labels.shape)
    return log_probs, (entropy.view(labels.shape) if return_token_entropy else None)


# ---------------------------------------------------------------- the output head, chunked


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
                 keep_hidden: bool, vocab_size: int | None):
        self.head, self.labels, self.want_entropy = head, labels, want_entropy
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
        if needs_grad and _fusable(self.head, self.inner):
            log_probs, entropy = _FusedHeadStats.apply(hidden.reshape(-1, hidden.shape[-1]), self.head.weight,
                                                       self.head.bias, self.labels.reshape(-1), self.temperature,
                                                       self.step, self.want_entropy)
        else:
            log_probs, entropy = _chunked_stats(hidden.reshape(-1, hidden.shape[-1]), self.labels.reshape(-1),
                                                self.inner, self.want_entropy, self.temperature, self.step,
                                                owned=True, needs_grad=needs_grad)
        packed = torch.stack([log_probs, entropy], -1) if self.want_entropy else log_probs.unsqueeze(-1)
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
) -> dict[str, torch.Tensor]:
    """Log-probs of ``labels`` (batch, seq) under softmax(logits / ``temperature``) of the forward
    ``forward(**extra)`` of ``model`` (a closure calling the model, or its engine wrapper, on the
    inputs whose logits line up with ``labels``), without the (batch, seq, vocab) logits: see the
    module doc. Returns ``log_probs``, ``token_entropy`` when asked, and ``last_hidden_state`` (the
    head's input, (batch, seq, hidden)) when asked."""
    temperature = _check_temperature(temperature)
    head = output_head(model)
    out: dict[str, torch.Tensor] = {}
    if head is not None:
        cfg = getattr(unwrap_model(model), "config", None)
        with _ChunkedHead(head, labels, return_token_entropy, temperature, chunk_tokens, return_last_hidden,
                          getattr(cfg, "vocab_size", None)) as chunked:
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
    out["log_probs"] = log_probs
    if return_token_entropy:
        out["token_entropy"] = entropy
    return out


def get_response_log_probs(
    model: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    return_last_hidden: bool = False,
) -> dict[str, torch.Tensor]:
    """Log-probabilities of ``labels`` under a causal LM (CS336 A5 ``get_response_log_probs``).

    Returns ``{"log_probs": (batch, seq)}`` and, when asked, ``"token_entropy": (batch, seq)``, both
    of ``softmax(logits / temperature)`` (keyword-only, > 0; pass the sampling temperature so the
    log-probs in ratios and KLs are of the distribution that drew the tokens). No masking and no
    ``no_grad`` here: the caller decides. ``attention_mask`` (keyword-only, optional) is passed to
    the model; right-padded batches do not need it for the non-pad positions.

    The logits are never whole: at most ``chunk_tokens`` positions of them at a time (default: one
    ``LOGITS_CHUNK_BYTES`` float32 block), with the same values and gradients as the unchunked
    computation (``log_probs_from_forward``). ``return_last_hidden`` adds ``"last_hidden_state"``
    (batch, seq, hidden), the output head's input (PPO's value head reads it).
    """
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    return log_probs_from_forward(model, labels, lambda **extra: model(input_ids, **kwargs, **extra),
                                  return_token_entropy, temperature=temperature, chunk_tokens=chunk_tokens,
                                  return_last_hidden=return_last_hidden)


def pack_rows(lengths: Sequence[int], token_budget: int | None = None) -> list[list[int]]:
    """Consecutive row indices grouped so that each group's padded size (rows x its longest row)
    stays within ``token_budget`` (default ``INFERENCE_TOKEN_BUDGET``); a row longer than the budget
    is a group of its own. Inference paths run one forward per group."""
    budget = INFERENCE_TOKEN_BUDGET if token_budget is None else int(token_budget)
    if budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, length in enumerate(lengths):
        candidate = max(longest, int(length))
        if current and candidate * (len(current) + 1) > budget:
            groups.append(current)
            current, candidate = [], int(length)
        current.append(i)
        longest = candidate
    if current:
        groups.append(current)
    return groups


def tokenize_prompt_and_output(
    prompt_strs: list[str], output_strs: list[str], tokenizer: Any
) -> dict[str, torch.Tensor]:
    """Tokenise prompts and outputs separately and build shifted LM inputs (CS336 A5).

    Returns ``input_ids`` (B, L-1), ``labels`` (B, L-1) and ``response_mask`` (B, L-1, bool), where
    L is the longest prompt+output length; sequences are right-padded with the pad id (eos when the
    tokenizer has no pad token). ``response_mask`` is true where the label is an output token.
    """
    if len(prompt_strs) != len(output_strs):
        raise ValueError(f"got {len(prompt_strs)} prompts but {len(output_strs)} outputs")
    prompt_ids = tokenizer(list(prompt_strs), add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(list(output_strs), add_special_tokens=False)["input_ids"]
    return build_sequences(prompt_ids, output_ids, pad_token_id(tokenizer))


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
    lp = get_response_log_probs(model, input_ids, labels, temperature=temperature)["log_probs"]
    return (lp * mask).sum(-1), mask.sum(-1)


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, falling back to eos (as CS336 and most causal LMs do)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("tokenizer has neither a pad token nor an eos token")
    return int(pad)


def build_sequences(
    prompt_ids: list[list[int]], output_ids: list[list[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Concatenate token-id lists, right-pad, shift: the tensor half of ``tokenize_prompt_and_output``.

    Trainers call this with the exact sampled token ids, so nothing is re-tokenised.
    """
    lengths = [len(p) + len(o) for p, o in zip(prompt_ids, output_ids)]
    max_len = max(lengths)
    batch = len(lengths)
    full = torch.full((batch, max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, max_len), dtype=torch.bool)
    for i, (p, o) in enumerate(zip(prompt_ids, output_ids)):
        n_p, n_o = len(p), len(o)
        full[i, : n_p + n_o] = torch.tensor(list(p) + list(o), dtype=torch.long)
        mask[i, n_p : n_p + n_o] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": mask[:, 1:]}
