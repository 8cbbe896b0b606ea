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

from .arithmetic import ArithmeticTask
from .base import SPLITS, Task, apply_op, split_of, wrong_value
from .countdown import CountdownTask
from .registry import TASKS, get_task
from .retrieval import RetrievalTask, retrieval_reward_fn

__all__ = [
    "SPLITS", "TASKS", "ArithmeticTask", "CountdownTask", "RetrievalTask", "Task", "apply_op", "get_task",
    "retrieval_reward_fn", "split_of", "wrong_value",
]
