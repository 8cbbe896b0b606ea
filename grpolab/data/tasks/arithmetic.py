"""Multi-step integer arithmetic, worked one operation per step."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ...rewards.tasks import arithmetic_reward_fn
from ..datasets import Example
from .base import Task, apply_op, wrong_value

PHRASINGS = ("compact", "words")


def in_words(compact: str) -> str:
    """``3+4*-2`` -> ``What is 3 + 4 * -2?``: spaces around each operator (a sign stays on its number)."""
    out, prev = [], None
    for ch in compact:
        if ch in "+-*" and prev is not None and prev.isdigit():
            out.append(f" {ch} ")
        else:
            out.append(ch)
        prev = ch
    return f"What is {''.join(out)}?"


@dataclass
class ArithmeticTask(Task):
    """Multi-step integer arithmetic: ``num_ops`` operations on ``digits``-digit numbers.

    Multiplication binds tighter than ``+``/``-``; the worked solution reduces one operation per
    step (multiplications first, then left to right).

    ``phrasing``: ``compact`` (``3+4-2``, the default) or ``words`` (``What is 3 + 4 - 2?``, a
    question a chat model reads as one). A words question is its compact form reworded after the
    draw: the same questions, answers, worked solutions and splits (the split hashes the compact
    form) whatever the phrasing.
    """

    digits: int = 1
    num_ops: int = 2
    ops: str = "+-"
    phrasing: str = "compact"
    name = "arithmetic"
    # a question's numbers and its answer stay printable: a product of num_ops + 1 numbers of
    # `digits` digits has up to 40 * 101 = 4040 digits, within Python's int-to-str limit (4300)
    option_bounds = {**Task.option_bounds, "digits": (1, 40), "num_ops": (1, 100)}
    option_choices = {**Task.option_choices, "phrasing": PHRASINGS}

    def __post_init__(self):
        super().__post_init__()
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"task_options of arithmetic: ops must be one or more of '+-*', got {self.ops!r}")
        self.reward_fn = arithmetic_reward_fn

    def _make(self, rng: random.Random, wrong: bool) -> Example:
        hi = 10**self.digits - 1
        nums = [rng.randint(0, hi) for _ in range(self.num_ops + 1)]
        ops = [rng.choice(self.ops) for _ in range(self.num_ops)]
        question = "".join(f"{n}{o}" for n, o in zip(nums, ops)) + str(nums[-1])
        wrong_step = rng.randrange(self.num_ops) if wrong and self.wrong_kind == "step" else -1
        steps, value, answer = _solve(nums, ops, wrong_step, rng)
        final = wrong_value(value, rng) if wrong and self.wrong_kind == "answer" else value
        solution = " ".join(steps) + f"</think> <answer>{final}</answer>"
        return Example(question, str(answer), solution)

    def examples(self, split: str, n: int) -> list[Example]:
        """The compact draw (so the split and order never depend on the phrasing), reworded."""
        out = super().examples(split, n)
        if self.phrasing == "words":
            for ex in out:
                ex.meta["compact_question"] = ex.question
                ex.question = in_words(ex.question)
        return out

    def wrong_solution(self, example: Example, rng: random.Random, kind: str = "answer") -> str:
        """The same question's worked solution, wrong: ``answer`` (right steps, a wrong final
        answer) or ``step`` (one step's result off, the error carried to a consistent final answer)."""
        if kind == "step":
            compact = example.meta.get("compact_question", example.question)
            nums = [int(n) for n in re.findall(r"\d+", compact)]
            ops = re.findall(r"(?<=\d)[+\-*]", compact)
            steps, value, _ = _solve(nums, ops, rng.randrange(len(ops)), rng)
            return " ".join(steps) + f"</think> <answer>{value}</answer>"
        head, _, rest = example.solution.rpartition("<answer>")
        value = int(rest.split("</answer>")[0])
        return f"{head}<answer>{wrong_value(value, rng)}</answer>"


def _solve(nums: list[int], ops: list[str], wrong_step: int, rng: random.Random) -> tuple[list[str], int, int]:
    """The worked steps (multiplications first, then left to right), the value they reach and the
    true value; step ``wrong_step`` (-1: none) is off by a little and the error is carried on."""
    steps = []
    values, true_values, ops_left = list(nums), list(nums), list(ops)
    step = 0
    while ops_left:
        i = ops_left.index("*") if "*" in ops_left else 0
        a, op, b = values[i], ops_left[i], values[i + 1]
        result = apply_op(a, op, b)
        true_result = apply_op(true_values[i], op, true_values[i + 1])
        if step == wrong_step:
            result = wrong_value(result, rng)
        steps.append(f"{a}{op}{b}={result}")
        values[i : i + 2] = [result]
        true_values[i : i + 2] = [true_result]
        ops_left.pop(i)
        step += 1
    return steps, values[0], true_values[0]
