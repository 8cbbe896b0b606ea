"""The embedded tasks by name."""

from __future__ import annotations

from .arithmetic import ArithmeticTask
from .base import Task
from .countdown import CountdownTask
from .retrieval import RetrievalTask

TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "retrieval": RetrievalTask}


def get_task(name: str, **kwargs) -> Task:
    """The task ``name`` built with ``kwargs`` (its dataclass fields: ``seed``, ``wrong_fraction``, ...)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")
    return TASKS[name](**kwargs)
