"""What every embedded task shares: the hash split, the seeded draw of distinct questions, and the
integer helpers the worked solutions are built from."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable

from ..datasets import Example

SPLITS = ("train", "validation", "test")


def split_of(question: str) -> str:
    """A question's split, fixed by a hash of its text: 10 % test, 10 % validation, 80 % train."""
    bucket = int(hashlib.sha256(question.encode()).hexdigest(), 16) % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def apply_op(a: int, op: str, b: int) -> int:
    """``a op b`` for ``op`` in ``+ - * /`` (``/`` is floor division; the tasks use it only when exact)."""
    return a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b


def wrong_value(value: int, rng: random.Random) -> int:
    """A nearby wrong integer: ``value`` off by 1 or 2 either way."""
    return value + rng.choice([-2, -1, 1, 2])


@dataclass
class Task:
    """Base: ``examples(split, n)`` draws ``n`` distinct questions of that split, seeded."""

    seed: int = 0
    wrong_fraction: float = 0.0
    wrong_kind: str = "step"
    name = "task"
    default_template = "compact"
    reward_fn: Callable[[str, Any], dict] = None  # set by subclasses

    def __post_init__(self):
        if not 0.0 <= self.wrong_fraction <= 1.0:
            raise ValueError(f"wrong_fraction must be within [0, 1], got {self.wrong_fraction}")
        if self.wrong_kind not in ("step", "answer"):
            raise ValueError(f"wrong_kind must be 'step' or 'answer', got {self.wrong_kind!r}")

    def _make(self, rng: random.Random, wrong: bool) -> Example:  # pragma: no cover - abstract
        raise NotImplementedError

    def wrong_solution(self, example: Example, rng: random.Random) -> str:  # pragma: no cover - abstract
        """A worked solution of the same question whose final answer is wrong (for preference pairs)."""
        raise NotImplementedError

    def examples(self, split: str, n: int) -> list[Example]:
        """``n`` distinct questions of ``split``; the first ``k`` are the same whatever ``n`` is, so
        ``meta["source"]`` (``task:NAME:split:index``) names an example for good."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        offset = SPLITS.index(split)
        rng = random.Random(f"{self.name}:{self.seed}:{offset}")
        seen: set[str] = set()
        out: list[Example] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 200 * n + 10000:
                raise ValueError(f"task {self.name!r} has fewer than {n} distinct {split} questions at these settings")
            wrong = rng.random() < self.wrong_fraction
            ex = self._make(rng, wrong)
            if ex.question in seen or split_of(ex.question) != split:
                continue
            seen.add(ex.question)
            ex.meta["split"] = split
            ex.meta["solution_correct"] = not wrong
            ex.meta["source"] = f"task:{self.name}:{split}:{len(out)}"
            out.append(ex)
        return out
