"""Evaluation metrics on plain Python data: pass@k, maj@k, consistency, diversity, perplexity."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from ..rewards import is_equivalent
from .mode import eval_mode

Answer = Hashable | None
Equal = Callable[[str, str], bool]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, Codex):
    ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def answer_classes(answers: Sequence[Answer], equal: Equal = is_equivalent) -> list[int | None]:
    """One class id per answer, numbered in first-seen order: answers that ``equal`` judges the
    same answer share an id (by default mathematical equivalence, the reward's own grader, so
    ``"0.5"`` and ``"1/2"`` are one answer). A missing answer (None) has no class."""
    reps: list[Answer] = []
    seen: dict[Answer, int] = {}
    out: list[int | None] = []
    for a in answers:
        if a is None:
            out.append(None)
            continue
        if a not in seen:
            cls = next((i for i, rep in enumerate(reps) if equal(a, rep)), None)
            if cls is None:
                reps.append(a)
                cls = len(reps) - 1
            seen[a] = cls
        out.append(seen[a])
    return out


@dataclass(frozen=True)
class Vote:
    """Majority vote over one question's samples: ``maj`` (maj@k), ``consistency`` (share of the
    samples in the majority answer) and ``distinct`` (number of distinct answers)."""

    maj: float
    consistency: float
    distinct: int


def majority_vote(answers: Sequence[Answer], correct: Sequence[bool], equal: Equal = is_equivalent) -> Vote:
    """Self-consistency (Wang et al. 2023) with one grouping of the answers for every figure.

    maj@k is the expected correctness of a uniformly random pick among the answers tied for the
    majority: two answers tied and one right gives 0.5 (not whichever was seen first). An answer is
    right when any of its samples was graded right. Missing answers never vote or agree."""
    classes = answer_classes(answers, equal)
    counts = Counter(c for c in classes if c is not None)
    if not counts:
        return Vote(0.0, 0.0, 0)
    best = max(counts.values())
    top = [c for c, count in counts.items() if count == best]
    right = {c for c, ok in zip(classes, correct) if ok and c is not None}
    return Vote(sum(c in right for c in top) / len(top), best / len(answers), len(counts))


def maj_at_k(answers: Sequence[Answer], correct: Sequence[bool], equal: Equal = is_equivalent) -> float:
    """maj@k of one question (see ``majority_vote``)."""
    return majority_vote(answers, correct, equal).maj


def consistency(answers: Sequence[Answer], equal: Equal = is_equivalent) -> float:
    """Fraction of the samples that agree with the majority answer (a missing answer never agrees)."""
    return majority_vote(answers, [False] * len(answers), equal).consistency


def distinct_n(texts: Sequence[Sequence[Hashable]], n: int) -> float:
    """Distinct-n (Li et al. 2016): distinct n-grams over all n-grams, pooled over ``texts``
    (each a sequence of tokens: words or token ids)."""
    grams = [tuple(t[i : i + n]) for t in texts for i in range(len(t) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def mean_distinct_answers(groups: Sequence[Sequence[Answer]], equal: Equal = is_equivalent) -> float:
    """Mean number of distinct (non-missing, not equivalent) answers per question."""
    return sum(len(set(answer_classes(g, equal)) - {None}) for g in groups) / len(groups) if groups else 0.0


def check_perplexity_args(n_tokens: int, max_length: int, stride: int) -> None:
    """The checks ``perplexity`` makes, callable before any expensive work."""
    if stride < 1 or stride > max_length:
        raise ValueError(f"need 1 <= stride <= max_length, got stride={stride}, max_length={max_length}")
    if n_tokens < 2:
        raise ValueError("perplexity needs at least two tokens")


def perplexity(model, token_ids: Sequence[int], max_length: int = 512, stride: int = 256, device=None) -> float:
    """Perplexity of one token stream with a strided sliding window (the Hugging Face recipe): each
    window scores only its tokens not scored by the previous window, with up to ``max_length - stride``
    tokens of context before them. Dropout is off during the forwards (``eval_mode``)."""
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    check_perplexity_args(len(ids), max_length, stride)
    device = device or next(model.parameters()).device
    nll_sum, counted, prev_end = 0.0, 0, 0
    with eval_mode(model):
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
