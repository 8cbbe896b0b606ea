"""Multi-step integer arithmetic, worked one operation per step."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ...rewards.tasks import arithmetic_reward_fn
from ..datasets import Example
from .base import Task, apply_op, wrong_value


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
        steps = []
        wrong_step = rng.randrange(self.num_ops) if wrong and self.wrong_kind == "step" else -1
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
        answer = true_values[0]
        final = wrong_value(values[0], rng) if wrong and self.wrong_kind == "answer" else values[0]
        solution = " ".join(steps) + f"</think> <answer>{final}</answer>"
        return Example(question, str(answer), solution)

    def wrong_solution(self, example: Example, rng: random.Random) -> str:
        head, _, rest = example.solution.rpartition("<answer>")
        value = int(rest.split("</answer>")[0])
        return f"{head}<answer>{wrong_value(value, rng)}</answer>"
