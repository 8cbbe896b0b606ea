"""What every embedded task shares: the hash split, the seeded draw of distinct questions, and the
integer helpers the worked solutions are built from."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable

from ..datasets import Example
from .options import check_options, dataclass_fields

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
    # the settings' bounds (inclusive; None: open) and allowed values, checked with their types
    option_bounds = {"wrong_fraction": (0.0, 1.0)}
    option_choices = {"wrong_kind": ("step", "answer")}

    def __post_init__(self):
        self.check_settings()

    def check_settings(self) -> None:
        """One line naming the task and the setting for a wrong type, a value out of bounds or not
        among the allowed ones (``task_options of arithmetic: digits must be at least 1, got -5``)."""
        fields = dataclass_fields(type(self))
        check_options(self.name, {k: getattr(self, k) for k in fields}, fields, self.option_bounds)
        for key, allowed in self.option_choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"task_options of {self.name}: {key} must be one of {', '.join(map(repr, allowed))}, "
                                 f"got {getattr(self, key)!r}")

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


def plain(value: Any) -> Any:
    """``value`` as plain data (JSON types), so it can be sent to a worker and logged."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return value.item() if hasattr(value, "item") else str(value)  # numpy scalars; anything else as text
