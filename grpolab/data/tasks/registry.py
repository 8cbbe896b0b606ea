"""The embedded tasks by name."""

from __future__ import annotations

from .arithmetic import ArithmeticTask
from .base import Task
from .countdown import CountdownTask
from .gym import ReasoningGymTask  # reasoning-gym itself is imported only when such a task is built
from .retrieval import RetrievalTask

TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "retrieval": RetrievalTask}


def get_task(name: str, **kwargs) -> Task:
    """The task ``name`` built with ``kwargs`` (its dataclass fields: ``seed``, ``wrong_fraction``, ...);
    ``rg:NAME`` is a reasoning-gym generator (``kwargs``: its config fields)."""
    if name.startswith("rg:"):
        return ReasoningGymTask(name[3:], **kwargs)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}, or rg:NAME (reasoning-gym)")
    return TASKS[name](**kwargs)
