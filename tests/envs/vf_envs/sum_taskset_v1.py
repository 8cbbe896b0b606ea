"""A single-turn environment in verifiers' current API (``verifiers.v1``, 0.4): a ``Taskset`` whose
``load()`` yields ``SumTask(SumData)`` objects, scored by the task's ``@vf.reward`` methods over the
rollout's ``vf.Trace``. Exported through ``__all__``, as verifiers' loaders find a taskset.

``correct`` (weight 1.0): the reply's last number is the sum; ``short`` (weight 0.1): the reply is at
most 8 characters; ``length`` a metric (recorded, not summed). So "7" scores 1.1, "8" 0.1.
"""

import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumConfig(vf.TasksetConfig):
    n: int = 64
    """How many questions."""


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply) <= 8 else 0.0

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.n):
            yield SumTask(SumData(prompt=f"What is {i % 9} + {i // 9}?", answer=str(i % 9 + i // 9),
                                  system_prompt="Answer with the number only."), self.config.task)


__all__ = ["SumTaskset"]
