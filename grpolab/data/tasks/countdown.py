"""Countdown (TinyZero): reach a target with ``+ - * /`` over the given numbers."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ...rewards.tasks import countdown_reward_fn
from ..datasets import Example
from .base import Task, apply_op


@dataclass
class CountdownTask(Task):
    """Countdown (TinyZero): reach ``target`` with ``+ - * /`` using each given number at most once.

    Targets come from a random equation over all the numbers (exact division only), so every
    question is solvable; any equation the verifier accepts is correct.
    """

    num_numbers: int = 3
    max_number: int = 20
    name = "countdown"
    option_bounds = {**Task.option_bounds, "num_numbers": (2, 10), "max_number": (2, 10**6)}

    def __post_init__(self):
        super().__post_init__()
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
                new = apply_op(value, op, n)
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
