"""An environment written against verifiers' current API (``verifiers.v1``, the only API of 0.4): a
``Taskset`` of ``Task`` objects scored by the task's ``@vf.reward`` over the rollout's ``vf.Trace``.
Addition of a two-digit and a one-digit number, asked in words, for a chat model:

    env: {verifiers: configs/envs/vf_arithmetic_v1.py, args: {n: 700}}

One reward, ``correct`` (1.0 when the reply's last number is the sum). Questions come from one seeded
stream without repeats; grpolab splits them 80/10/10 by the prompt's hash (train, validation, test),
so ``grpolab eval --data vf:...`` scores questions the run never trained on.
"""

import random
import re

import verifiers.v1 as vf

SYSTEM_PROMPT = "You are a calculator. Reply with only the result. Example: What is 42 + 7? 49"


class SumData(vf.TaskData):
    answer: str


class ArithmeticConfig(vf.TasksetConfig):
    n: int = 700
    """How many questions (all splits together; at most 810, the pairs there are)."""
    seed: int = 0
    """Seed of the question stream."""


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0


class ArithmeticTaskset(vf.Taskset[SumTask, ArithmeticConfig]):
    def load(self):
        if not 0 < self.config.n <= 90 * 9:
            raise ValueError(f"n must be 1 to 810 (the pairs there are), got {self.config.n}")
        rng, seen = random.Random(self.config.seed), set()
        while len(seen) < self.config.n:
            a, b = rng.randint(10, 99), rng.randint(1, 9)
            if (a, b) in seen:
                continue
            seen.add((a, b))
            yield SumTask(SumData(prompt=f"What is {a} + {b}?", answer=str(a + b), system_prompt=SYSTEM_PROMPT),
                          self.config.task)


__all__ = ["ArithmeticTaskset"]
