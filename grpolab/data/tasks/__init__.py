"""Embedded tasks: generated, verifiable, deterministic per seed, nothing downloaded.

Splits never share a question: a question's split is fixed by a hash of its text (10 % test,
10 % validation, 80 % train), whatever the seed or the number of examples asked for.

Worked solutions use the R1-Zero format, as the response that follows the prompt's ``<think>``::

    3+5=8 8-2=6</think> <answer>6</answer>

``wrong_fraction`` makes that fraction of the worked solutions wrong, like imperfect distilled
traces: imitation alone then plateaus, and a verifier-driven method can beat it. ``wrong_kind``
says how: ``"step"`` (one step's result is off and the error is carried to the final answer) or
``"answer"`` (the steps are right but the final answer is off — the right work, the wrong answer).
Ground-truth answers are always right.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable

from ...rewards.tasks import arithmetic_reward_fn, countdown_reward_fn
from ..datasets import Example

SPLITS = ("train", "validation", "test")


def split_of(question: str) -> str:
    bucket = int(hashlib.sha256(question.encode()).hexdigest(), 16) % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b


def _wrong(value: int, rng: random.Random) -> int:
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
            out.append(ex)
        return out


@dataclass
class ArithmeticTask(Task):
    """Multi-step integer arithmetic: ``num_ops`` operations on ``digits``-digit numbers.

    Multiplication binds tighter than ``+``/``-``; the worked solution reduces one operation per
    step (multiplications first, then left to right).
    """

    digits: int = 1
    num_ops: int = 2
    ops: str = "+-"
    name = "arithmetic"

    def __post_init__(self):
        super().__post_init__()
        if self.digits < 1 or self.num_ops < 1 or not self.ops or set(self.ops) - set("+-*"):
            raise ValueError("arithmetic task: digits >= 1, num_ops >= 1, ops from '+-*'")
        self.reward_fn = arithmetic_reward_fn

    def _make(self, rng: random.Random, wrong: bool) -> Example:
        hi = 10**self.digits - 1
        nums = [rng.randint(0, hi) for _ in range(self.num_ops + 1)]
        ops = [rng.choice(self.ops) for _ in range(self.num_ops)]
        question = "".join(f"{n}{o}" for n, o in zip(nums, ops)) + str(nums[-1])
        steps, true_steps = [], []
        wrong_step = rng.randrange(self.num_ops) if wrong and self.wrong_kind == "step" else -1
        values, true_values, ops_left = list(nums), list(nums), list(ops)
        step = 0
        while ops_left:
            i = ops_left.index("*") if "*" in ops_left else 0
            a, op, b = values[i], ops_left[i], values[i + 1]
            result = _apply(a, op, b)
            true_result = _apply(true_values[i], op, true_values[i + 1])
            if step == wrong_step:
                result = _wrong(result, rng)
            steps.append(f"{a}{op}{b}={result}")
            true_steps.append(true_result)
            values[i : i + 2] = [result]
            true_values[i : i + 2] = [true_result]
            ops_left.pop(i)
            step += 1
        answer = true_values[0]
        final = _wrong(values[0], rng) if wrong and self.wrong_kind == "answer" else values[0]
        solution = " ".join(steps) + f"</think> <answer>{final}</answer>"
        return Example(question, str(answer), solution)


    def wrong_solution(self, example: Example, rng: random.Random) -> str:
        head, _, rest = example.solution.rpartition("<answer>")
        value = int(rest.split("</answer>")[0])
        return f"{head}<answer>{_wrong(value, rng)}</answer>"


@dataclass
class CountdownTask(Task):
    """Countdown (TinyZero): reach ``target`` with ``+ - * /`` using each given number at most once.

    Targets come from a random equation over all the numbers (exact division only), so every
    question is solvable; any equation the verifier accepts is correct.
    """

    num_numbers: int = 3
    max_number: int = 20
    name = "countdown"

    def __post_init__(self):
        super().__post_init__()
        if self.num_numbers < 2 or self.max_number < 2:
            raise ValueError("countdown task: num_numbers >= 2 and max_number >= 2")
        self.reward_fn = countdown_reward_fn

    def _make(self, rng: random.Random, wrong: bool) -> Example:
        while True:
            nums = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            order = nums[:]
            rng.shuffle(order)
            value, expr, prev_op = order[0], str(order[0]), None
            steps = []
            for n in order[1:]:
                choices = ["+", "-", "*"] + (["/"] if n and value % n == 0 else [])
                op = rng.choice(choices)
                new = _apply(value, op, n)
                steps.append(f"{value}{op}{n}={new}")
                expr = f"({expr}){op}{n}" if op in "*/" and prev_op in ("+", "-") else f"{expr}{op}{n}"
                value, prev_op = new, op
            if 0 < value <= 10 * self.max_number:
                break
        question = f"Use {' '.join(map(str, nums))} to make {value}"
        if wrong:
            # a wrong demonstration: the equation is off by one number and does not reach the target
            expr = f"{expr}+1" if rng.random() < 0.5 else f"{expr}-1"
        solution = " ".join(steps) + f"</think> <answer>{expr}</answer>"
        return Example(question, {"numbers": nums, "target": value}, solution)

    def wrong_solution(self, example: Example, rng: random.Random) -> str:
        head, _, rest = example.solution.rpartition("<answer>")
        equation = rest.split("</answer>")[0]
        return f"{head}<answer>{equation}{rng.choice(['+1', '-1'])}</answer>"


TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask}


def get_task(name: str, **kwargs) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")
    return TASKS[name](**kwargs)
