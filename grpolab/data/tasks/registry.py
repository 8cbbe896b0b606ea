"""The embedded tasks by name."""

from __future__ import annotations

from typing import Any, Mapping

from .arithmetic import ArithmeticTask
from .base import Task
from .countdown import CountdownTask
from .gym import ReasoningGymTask  # reasoning-gym itself is imported only when such a task is built
from .options import dataclass_fields
from .retrieval import RetrievalTask

TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "retrieval": RetrievalTask}


def get_task(name: str, seed: int = 0, *, options: Mapping[str, Any] | None = None, **fields) -> Task:
    """The task ``name`` with the settings ``options`` (a run's ``task_options``) and ``fields``
    (its dataclass fields: ``wrong_fraction``, ``digits``, ...); ``rg:NAME`` is a reasoning-gym
    generator (the settings: its config fields). ``seed`` is the run's; a ``seed`` among the
    settings wins (a reasoning-gym generator takes it as it is, the run's seed is spread apart).
    An unknown setting, one of the wrong type or out of range is one line naming the task and it."""
    settings = {**(options or {}), **fields}
    if name.startswith("rg:"):
        if not name[3:].strip():
            raise ValueError("task 'rg:' names no reasoning-gym dataset; give one after 'rg:' (e.g. "
                             "rg:basic_arithmetic)")
        return ReasoningGymTask(name[3:], seed, settings)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}, or rg:NAME (reasoning-gym)")
    known = dataclass_fields(TASKS[name])
    unknown = [key for key in settings if key not in known]
    if unknown:
        raise ValueError(f"task_options of {name}: unknown option {unknown[0]!r}; its options are: "
                         f"{', '.join(known)}")
    return TASKS[name](**{"seed": seed, **settings})
