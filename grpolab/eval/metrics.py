"""Evaluation metrics on plain Python data: pass@k, maj@k, consistency, diversity, perplexity."""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Sequence

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, Codex):
    ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_answer(answers: Sequence[Hashable | None]) -> Hashable | None:
    """The most common non-missing answer (ties: the first seen), or None."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> float:
    """1.0 when the majority answer of the samples is a correct one (self-consistency, Wang et al. 2023)."""
    top = majority_answer(answers)
    if top is None:
        return 0.0
    return float(any(ok for a, ok in zip(answers, correct) if a == top))


def consistency(answers: Sequence[Hashable | None]) -> float:
    """Fraction of the samples that agree with the majority answer (a missing answer never agrees)."""
    if not answers:
        return 0.0
    top = majority_answer(answers)
    return sum(a == top for a in answers if a is not None) / len(answers) if top is not None else 0.0


def distinct_n(texts: Sequence[Sequence[Hashable]], n: int) -> float:
    """Distinct-n (Li et al. 2016): distinct n-grams over all n-grams, pooled over ``texts``
    (each a sequence of tokens: words or token ids)."""
    grams = [tuple(t[i : i + n]) for t in texts for i in range(len(t) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def mean_distinct_answers(groups: Sequence[Sequence[Hashable | None]]) -> float:
    """Mean number of distinct (non-missing) answers per question."""
    return sum(len({a for a in g if a is not None}) for g in groups) / len(groups) if groups else 0.0


@torch.inference_mode()
def perplexity(model, token_ids: Sequence[int], max_length: int = 512, stride: int = 256, device=None) -> float:
    """Perplexity of one token stream with a strided sliding window (the Hugging Face recipe): each
    window scores only its tokens not scored by the previous window, with up to ``max_length - stride``
    tokens of context before them."""
    if stride < 1 or stride > max_length:
        raise ValueError(f"need 1 <= stride <= max_length, got stride={stride}, max_length={max_length}")
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    device = device or next(model.parameters()).device
    nll_sum, counted, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        window = ids[begin:end].to(device)[None]
        logits = model(window).logits[0, :-1].float()
        targets = window[0, 1:]
        nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        # positions end-1 .. of targets; only those past prev_end are new
        first_new = max(prev_end - begin - 1, 0)
        nll_sum += float(nll[first_new:].sum())
        counted += len(nll) - first_new
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / counted)
