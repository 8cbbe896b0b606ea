"""Per-token log-probabilities, entropy and prompt/response tokenisation (CS336 A5 §4.2).

Memory. A real vocabulary makes the logits the largest tensor of a forward: (batch, seq, vocab)
float32 is 6.4 GB for 32 rows of 1024 tokens over 49k tokens, and a log-softmax makes copies of it.
Here log-probs and entropies are computed over chunks of positions, so at most one (chunk, vocab)
block of logits (``LOGITS_CHUNK_BYTES``, float32) and the few temporaries of its log-softmax exist
at a time. With gradients, each chunk is checkpointed (``torch.utils.checkpoint``): the backward
recomputes a chunk's logits instead of keeping every chunk's, and the gradient equals the
unchunked one. ``models.fused_head`` applies the same chunking inside a model's output head, so
that the whole logits never exist at all. Inference callers also bound the rows of a forward by
tokens (``pack_rows``, ``INFERENCE_TOKEN_BUDGET``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

# one (chunk, vocab) float32 logits block at most: 128 MiB is 682 positions of a 49k vocabulary
LOGITS_CHUNK_BYTES = 128 * 2**20
# rows x padded length of one forward in the inference paths (eval entropies, old/reference log-probs)
INFERENCE_TOKEN_BUDGET = 8192


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


def check_temperature(temperature: float) -> float:
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


def chunked_token_stats(source: torch.Tensor, labels: torch.Tensor, to_logits: Callable[[torch.Tensor], torch.Tensor],
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
    temperature = check_temperature(temperature)
    vocab = logits.shape[-1]
    step = logits_chunk_tokens(vocab, chunk_tokens)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    log_probs, entropy = chunked_token_stats(logits.reshape(-1, vocab), labels.reshape(-1), lambda z: z,
                                             return_token_entropy, temperature, step, owned=False,
                                             needs_grad=needs_grad)
    log_probs = log_probs.view(labels.shape)
    return log_probs, (entropy.view(labels.shape) if return_token_entropy else None)


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
    the model; right-padded batches do not need it for the non-pad positions. ``return_last_hidden``
    adds ``"last_hidden_state"`` (batch, seq, hidden), the output head's input.

    The reference computation: the model's forward returns its whole (batch, seq, vocab) logits and
    only their log-softmax is chunked (``log_probs_from_logits``). The trainers call
    ``models.fused_head.response_log_probs``, which gives the same values and gradients without the
    whole logits.
    """
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    result = model(input_ids, **kwargs, **({"output_hidden_states": True} if return_last_hidden else {}))
    log_probs, entropy = log_probs_from_logits(result.logits, labels, return_token_entropy, temperature=temperature,
                                               chunk_tokens=chunk_tokens)
    out = {"log_probs": log_probs}
    if return_token_entropy:
        out["token_entropy"] = entropy
    if return_last_hidden:
        out["last_hidden_state"] = result.hidden_states[-1]
    return out


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
