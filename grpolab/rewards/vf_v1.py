"""An environment written against verifiers' current API (``verifiers.v1``, the only API of 0.4) as
``env: {verifiers: FILE_OR_MODULE}``: a module without a classic ``load_environment`` that exports its
``vf.Taskset`` subclass through ``__all__`` (verifiers' own loader convention, ``load_taskset``).

What runs, and where:

- **Tasks are rows.** Each task's ``prompt`` (and ``system_prompt``) is a row's chat prompt;
  ``env.args`` is the taskset's config (its ``TasksetConfig``). The ground truth names a task by its
  content hash (``Task.hash``), never carries code: the worker loads the configured taskset and
  scores the task of that hash.
- **Single-turn** (no toolsets): grpolab samples the reply.
- **Tools** (``Task.toolsets(config)`` / ``Taskset.toolsets(config)``, ``vf.Toolset`` classes with
  ``@vf.tool`` methods): grpolab plays verifiers' ``null`` harness, the chat loop with the task's
  tools: it samples each model turn in the model's own function-calling format and runs the tools
  in-process (``grpolab.envs.vf_v1_tools``), the schemas being the ones the toolset's MCP server
  advertises, named ``<server>_<tool>`` (bare with ``TOOL_PREFIX = None``). A fresh toolset per
  rollout (``setup()``, ``setup_task(task)``), its ``self.state`` the rollout's ``trace.state``.
- **Scoring.** The task's ``@vf.reward`` / ``@vf.metric`` methods and plugged judges score a
  ``vf.Trace`` of the prompt, the conversation and the state (``Task.score(trace)`` with no runtime:
  a reward that needs one is skipped, as verifiers skips it offline), in the reward workers.
- **Judges** (``TaskConfig.judges``) run where they can: against an OpenAI-compatible endpoint on
  this machine (``base_url`` on 127.0.0.1/localhost, e.g. ``grpolab serve``); any other endpoint is
  refused in one line naming the field.

Refused in one line naming it (grpolab runs no sandbox or agent program): a bundled ``vf.Harness``
or ``vf.Env``, a task that ``NEEDS_CONTAINER`` or overrides ``setup``/``finalize``/
``stage_verifier`` (they take a runtime), ``@vf.stop`` / ``@vf.intercept`` hooks, a toolset with a
``url`` (a remote MCP server) or a runtime other than ``subprocess``, an infinite taskset.
"""

from __future__ import annotations

import asyncio
import sys
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

TASKSET_HINT = "a verifiers.v1 taskset module exports its vf.Taskset subclass via __all__"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
RUNTIME_HOOKS = ("setup", "finalize", "stage_verifier")


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
    """A ``verifiers.v1`` taskset as grpolab's verifiers environment: its tasks as rows
    (``build_dataset``), its toolsets (``toolsets_of``) and ``score(row, completion, state)`` by the
    task's rewards (see the module docstring)."""

    eval_dataset = None  # a taskset is one stream of tasks: grpolab splits it by prompt hash
    has_group_rewards = False  # a v1 task scores one trace; cross-agent judgement is an Env's, not run here

    def __init__(self, spec: str, module: ModuleType, args: dict[str, Any]):
        import verifiers.v1 as vf
        from verifiers.v1.utils.generic import concrete_type
        from verifiers.v1.utils.loaders import _plugin_class

        self.spec = spec
        what = self.what = f"verifiers environment {spec!r}"
        try:
            cls = _plugin_class(module, vf.Taskset, "taskset")
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"{what}: {_line(exc)}") from None
        config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        try:
            config = config_type.model_validate(dict(args))
        except ValueError as exc:  # pydantic's ValidationError
            raise ValueError(f"env.args of {what} do not fit its {config_type.__name__}: {_line(exc)}") from None
        _refuse_bundled(what, module, vf)
        try:
            taskset = cls(config)
            if getattr(taskset, "INFINITE", False):
                raise ValueError(f"{cls.__name__} is infinite; grpolab needs a bounded taskset (give a size in "
                                 "env.args)")
            self.tasks = list(taskset)
            self.shared_toolsets = list(cls.toolsets(config))  # one instance per run, as verifiers shares them
        except Exception as exc:  # noqa: BLE001 - the taskset's own code: one line
            raise ValueError(f"{what}: loading its tasks ({cls.__name__}.load) raised {type(exc).__name__}: "
                             f"{_line(exc)}") from None
        self.name = cls.__name__
        self.by_hash = {task.hash: task for task in self.tasks}
        self._message = vf.Message
        self._vf = vf
        for task in self.tasks[:1]:  # one task type per taskset (verifiers' rule): the first tells its class
            _refuse_runtime_needs(what, task, vf)
            for toolset in self.shared_toolsets + self.toolsets_of(task, shared=False):
                _refuse_remote_toolset(what, toolset)
        self.kind = "tool" if self.tasks and (self.shared_toolsets or self.toolsets_of(self.tasks[0], False)) \
            else "single_turn"

    def toolsets_of(self, task, shared: bool = True) -> list:
        """The toolsets a rollout of ``task`` calls: fresh ones of ``Task.toolsets(task.config)`` (one per
        rollout, as verifiers launches them) and, with ``shared``, the taskset's shared ones."""
        try:
            own = list(type(task).toolsets(task.config))
        except Exception as exc:  # noqa: BLE001 - the task's own code
            raise ValueError(f"{self.what}: {type(task).__name__}.toolsets raised {type(exc).__name__}: "
                             f"{_line(exc)}") from None
        return own + (self.shared_toolsets if shared else [])

    def build_dataset(self) -> list[dict]:
        """One row per task: ``prompt`` (chat messages: the system prompt, then the task's prompt) and
        ``task_hash``, the task it scores with."""
        return [{"prompt": self.prompt(task), "task_hash": task.hash} for task in self.tasks]

    def build_eval_dataset(self) -> None:
        return None

    def task_of(self, row: dict):
        """The task a row (or a ground truth's row) names by its ``task_hash``; one line when none."""
        task = self.by_hash.get(row.get("task_hash") if isinstance(row, dict) else None)
        if task is None:
            raise ValueError(f"vf_rubric: the example's task is not one of {self.what}'s tasks (its task_hash)")
        return task

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

    def new_state(self, task):
        """A fresh rollout state of ``task``'s ``vf.State`` type (what its toolsets' ``self.state`` is)."""
        from verifiers.v1.state import state_cls

        return state_cls(type(task))()

    def score(self, row: dict, completion: list[dict], state: dict | None = None) -> dict[str, float]:
        """The task's rewards on ``completion`` (the conversation after the prompt: OpenAI chat messages,
        assistant ``tool_calls`` and ``tool`` results included) with the rollout's ``state`` (its
        toolsets' ``self.state``, as JSON): ``reward`` (their weighted sum, ``Trace.reward``), each
        reward and metric as ``vf/NAME``. A reward that raises is one ``ValueError`` line."""
        from pydantic import TypeAdapter
        from verifiers.v1.graph import MessageNode

        what, task = self.what, self.task_of(row)
        vf, adapter = self._vf, TypeAdapter(self._message)
        prompt = self.prompt(task)
        try:
            messages = [adapter.validate_python(_v1_message(m)) for m in prompt + list(completion)]
            live = self.new_state(task) if state is None else type(self.new_state(task)).model_validate(state)
        except ValueError as exc:
            raise ValueError(f"{what}: the completion is not verifiers chat messages ({_line(exc)})") from None
        nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=i >= len(prompt) and m.role == "assistant")
                 for i, m in enumerate(messages)]
        trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                         agent=vf.AgentInfo(config=vf.AgentConfig(), name="grpolab"), nodes=nodes,
                         is_completed=True, ok=True, state=live)
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


def _v1_message(message: dict) -> dict:
    """An OpenAI chat message as verifiers.v1 types it: a call's ``function`` flattened to ``name`` and
    ``arguments`` (``vf.ToolCall``)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"} if isinstance(message, dict) else message
    flat = [{"id": c.get("id", ""), "name": (c.get("function") or c).get("name"),
             "arguments": (c.get("function") or c).get("arguments") or "{}"} for c in calls]
    return {**message, "tool_calls": flat}


def _refuse_bundled(what: str, module: ModuleType, vf) -> None:
    """A taskset module that also exports a ``vf.Harness`` (its own agent program) or a ``vf.Env``
    (a multi-agent episode): one line, as grpolab runs neither."""
    for name in getattr(module, "__all__", None) or ():
        obj = getattr(module, name, None)
        if isinstance(obj, type) and issubclass(obj, vf.Harness) and obj is not vf.Harness:
            raise ValueError(f"{what}: exports the harness {name} (a vf.Harness runs its own program in a runtime); "
                             "grpolab runs a taskset's toolsets itself (verifiers' null harness), no other harness")
        if isinstance(obj, type) and issubclass(obj, vf.Env) and obj is not vf.Env:
            raise ValueError(f"{what}: exports the environment {name} (a vf.Env's run/finalize over agents); "
                             "grpolab runs one agent per task (SingleAgentEnv), not a custom Env")


def _refuse_runtime_needs(what: str, task, vf) -> None:
    """What of a task needs a sandbox runtime or hooks into verifiers' own rollout: one line naming it."""
    name = type(task).__name__
    if getattr(task, "NEEDS_CONTAINER", False):
        raise ValueError(f"{what}: task {name} sets NEEDS_CONTAINER (a container runtime); grpolab runs no sandbox")
    for hook in RUNTIME_HOOKS:
        if getattr(type(task), hook, None) is not getattr(vf.Task, hook, None):
            raise ValueError(f"{what}: task {name} overrides {hook}(trace, runtime), which needs a runtime (a "
                             "sandbox); grpolab runs none")
    from verifiers.v1.utils.decorators import discover_decorated

    for kind in ("stop", "intercept"):
        hooks = task.hooks("stop") if kind == "stop" else discover_decorated(task, "intercept")
        if hooks:
            raise ValueError(f"{what}: task {name}'s @vf.{kind} {hooks[0].__name__} hooks verifiers' interception "
                             "server, which grpolab does not run (its turns go through grpolab's sampler)")
    for i, judge in enumerate(getattr(task.config, "judges", None) or []):
        host = urlparse(str(getattr(judge, "base_url", "") or "")).hostname
        if host not in LOCAL_HOSTS:
            raise ValueError(f"{what}: task.judges[{i}].base_url is {judge.base_url!r}; grpolab runs a judge only "
                             "against an endpoint on this machine (127.0.0.1 or localhost, e.g. grpolab serve MODEL)")


def _refuse_remote_toolset(what: str, toolset) -> None:
    name, config = type(toolset).__name__, getattr(toolset, "config", None)
    if getattr(config, "url", None):
        raise ValueError(f"{what}: toolset {name} has a url ({config.url}): a remote MCP server, which grpolab does "
                         "not call; it runs a toolset's @vf.tool methods in-process")
    runtime = getattr(getattr(config, "runtime", None), "type", "subprocess")
    if runtime != "subprocess":
        raise ValueError(f"{what}: toolset {name}'s runtime is {runtime!r} (a sandbox grpolab does not run); "
                         "leave it subprocess: grpolab runs its @vf.tool methods in-process")
