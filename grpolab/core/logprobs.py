"""Per-token log-probabilities, entropy and prompt/response tokenisation (CS336 A5 §4.2)."""

from __future__ import annotations

from typing import Any

import torch


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


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``labels`` (batch, seq) under ``softmax(logits / temperature)``, logits
    (batch, seq, vocab), and that distribution's per-position entropy when asked (else None).

    ``temperature`` (> 0) is the sampler's: the policy being optimised is the tempered softmax
    that drew the tokens (as TRL and veRL do). One logsumexp serves both outputs; the
    (batch, seq, vocab) log-softmax is never materialised. bf16/fp16 logits are reduced in float32.
    """
    temperature = _check_temperature(temperature)
    logits = _upcast(logits)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    label_logits = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    log_probs = label_logits - lse
    entropy = None
    if return_token_entropy:
        probs = torch.exp(logits - lse.unsqueeze(-1))
        entropy = lse - (probs * logits).sum(dim=-1)
    return log_probs, entropy


def get_response_log_probs(
    model: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Log-probabilities of ``labels`` under a causal LM (CS336 A5 ``get_response_log_probs``).

    Returns ``{"log_probs": (batch, seq)}`` and, when asked, ``"token_entropy": (batch, seq)``, both
    of ``softmax(logits / temperature)`` (keyword-only, > 0; pass the sampling temperature so the
    log-probs in ratios and KLs are of the distribution that drew the tokens). No masking and no
    ``no_grad`` here: the caller decides. ``attention_mask`` (keyword-only, optional) is passed to
    the model; right-padded batches do not need it for the non-pad positions.
    """
    _check_temperature(temperature)  # before the forward pass
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    logits = model(input_ids, **kwargs).logits
    log_probs, entropy = log_probs_from_logits(logits, labels, return_token_entropy, temperature=temperature)
    out = {"log_probs": log_probs}
    if return_token_entropy:
        out["token_entropy"] = entropy
    return out


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
