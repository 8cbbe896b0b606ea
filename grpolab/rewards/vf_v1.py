"""An environment written against verifiers' current API (``verifiers.v1``, the only API of 0.4) as
``env: {verifiers: FILE_OR_MODULE}``: a module without a classic ``load_environment`` that exports its
``vf.Taskset`` subclass through ``__all__`` (verifiers' own loader convention, ``load_taskset``).

Single-turn only: each task's ``prompt`` (and ``system_prompt``) is a row's chat prompt, grpolab samples
the reply, and the task's own ``@vf.reward`` / ``@vf.metric`` methods score it over a ``vf.Trace`` built
from the prompt and the reply (``Task.score(trace)`` with no runtime: a reward that needs one is
skipped, as verifiers skips it offline). ``env.args`` is the taskset's config (its ``TasksetConfig``).
The ground truth names a task by its content hash (``Task.hash``), never carries code: the worker
loads the configured taskset and scores the task of that hash. Harnesses, runtimes, tools and
``Env`` finalize (cross-agent judgement) are not run; judges run where the task plugs them in.
"""

from __future__ import annotations

import asyncio
import sys
from types import ModuleType
from typing import Any

TASKSET_HINT = "a verifiers.v1 taskset module exports its vf.Taskset subclass via __all__"


def exports_v1_taskset(module: ModuleType) -> bool:
    """Whether ``module`` exports a ``verifiers.v1.Taskset`` subclass through ``__all__`` (read without
    importing verifiers: a module that defines one has imported it)."""
    v1 = sys.modules.get("verifiers.v1")
    base = getattr(v1, "Taskset", None)
    if base is None:
        return False
    exported = [getattr(module, name, None) for name in getattr(module, "__all__", None) or ()]
    return any(isinstance(obj, type) and issubclass(obj, base) and obj is not base for obj in exported)


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


class V1Taskset:
    """A ``verifiers.v1`` taskset as grpolab's verifiers environment (single-turn): its tasks as
    rows (``build_dataset``), and ``score(row, completion)`` by the task's rewards."""

    eval_dataset = None  # a taskset is one stream of tasks: grpolab splits it by prompt hash
    has_group_rewards = False  # a v1 task scores one trace; cross-agent judgement is an Env's, not run here

    def __init__(self, spec: str, module: ModuleType, args: dict[str, Any]):
        import verifiers.v1 as vf
        from verifiers.v1.utils.generic import concrete_type
        from verifiers.v1.utils.loaders import _plugin_class

        self.spec = spec
        what = f"verifiers environment {spec!r}"
        try:
            cls = _plugin_class(module, vf.Taskset, "taskset")
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"{what}: {_line(exc)}") from None
        config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        try:
            config = config_type.model_validate(dict(args))
        except ValueError as exc:  # pydantic's ValidationError
            raise ValueError(f"env.args of {what} do not fit its {config_type.__name__}: {_line(exc)}") from None
        try:
            taskset = cls(config)
            if getattr(taskset, "INFINITE", False):
                raise ValueError(f"{cls.__name__} is infinite; grpolab needs a bounded taskset (give a size in "
                                 "env.args)")
            self.tasks = list(taskset)
        except Exception as exc:  # noqa: BLE001 - the taskset's own code: one line
            raise ValueError(f"{what}: loading its tasks ({cls.__name__}.load) raised {type(exc).__name__}: "
                             f"{_line(exc)}") from None
        self.name = cls.__name__
        self.by_hash = {task.hash: task for task in self.tasks}
        self._message = vf.Message
        self._vf = vf

    def build_dataset(self) -> list[dict]:
        """One row per task: ``prompt`` (chat messages: the system prompt, then the task's prompt) and
        ``task_hash``, the task it scores with."""
        return [{"prompt": self.prompt(task), "task_hash": task.hash} for task in self.tasks]

    def build_eval_dataset(self) -> None:
        return None

    @staticmethod
    def prompt(task) -> list[dict]:
        data = task.data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [m.model_dump(mode="json", exclude_none=True) for m in data.prompt or []]
        return messages

    def roles(self) -> tuple[str | None, None]:
        """The answer reward (largest positive weight, first by verifiers' order on a tie) and no format
        function (a v1 task has no parser), as ``eval.evaluation.rubric_roles`` reads a rubric."""
        task = self.tasks[0] if self.tasks else None
        rewards = task.hooks("reward") if task is not None else []
        weighted = [(getattr(fn, "_vf_weight", 1.0), -i, fn.__name__) for i, fn in enumerate(rewards)]
        positive = [w for w in weighted if w[0] > 0]
        return (max(positive)[2] if positive else None), None

    def score(self, row: dict, completion: list[dict]) -> dict[str, float]:
        """The task's rewards on ``completion`` (the reply's chat messages) after the row's prompt:
        ``reward`` (their weighted sum, ``Trace.reward``), each reward as ``vf/NAME`` and each metric
        as ``vf/NAME``. A reward that raises is one ``ValueError`` line (a counted reward error)."""
        from pydantic import TypeAdapter
        from verifiers.v1.graph import MessageNode

        what = f"verifiers environment {self.spec!r}"
        task = self.by_hash.get(row.get("task_hash") if isinstance(row, dict) else None)
        if task is None:
            raise ValueError(f"vf_rubric: the example's task is not one of {what}'s tasks (its task_hash)")
        vf, adapter = self._vf, TypeAdapter(self._message)
        try:
            messages = [adapter.validate_python(m) for m in self.prompt(task) + list(completion)]
        except ValueError as exc:
            raise ValueError(f"{what}: the completion is not verifiers chat messages ({_line(exc)})") from None
        nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=i >= len(messages) - len(completion))
                 for i, m in enumerate(messages)]
        trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                         agent=vf.AgentInfo(config=vf.AgentConfig(), name="grpolab"), nodes=nodes,
                         is_completed=True, ok=True)
        try:
            asyncio.run(task.score(trace))
        except Exception as exc:  # noqa: BLE001 - the task's own code (verifiers wraps it in a TaskError)
            raise ValueError(f"{what}: the task's scoring failed: {_line(exc)}") from None
        unscored = [name for name, value in {**trace.rewards, **trace.metrics}.items() if value is None]
        if unscored:
            raise ValueError(f"{what}: {', '.join(unscored)} not scored")
        out = {"reward": trace.reward}
        out.update({f"vf/{name}": r.score for name, r in trace.rewards.items()})
        out.update({f"vf/{name}": value for name, value in trace.metrics.items()})
        return out
