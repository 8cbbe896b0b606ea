"""A ``verifiers.v1`` taskset's toolsets in grpolab's function-calling loop (``env: {verifiers: FILE}``
whose tasks have toolsets; ``rewards/vf_v1.py`` loads and scores the taskset).

grpolab plays verifiers' ``null`` harness, the chat loop with the task's MCP tools, with grpolab's
own machinery (``chat_rollouts.ChatToolEnv``): grpolab samples each model turn in the model's own
function-calling format (the chat template renders the schemas), runs the calls, appends the
``tool`` results, and the model goes on, up to ``max_turns``. What verifiers does over MCP runs here
in-process:

- **Schemas**: the ones each toolset's MCP server advertises (``Toolset.register`` on an MCP server,
  ``list_tools``), named ``<server>_<tool>`` as verifiers' chat program names them (the server's
  snake-cased class name, or bare with ``TOOL_PREFIX = None``).
- **Per rollout**: fresh toolsets of ``Task.toolsets(task.config)`` (``setup()`` then
  ``setup_task(task)``), as verifiers launches them per rollout; the taskset's shared toolsets are
  set up once. A tool's ``self.state`` is the rollout's state (the task's ``vf.State`` type), which
  the rollout carries to the task's rewards (``Rollout.info["vf_state"]``, the trace's ``state``).
- **Calls**: the ``@vf.tool`` method itself, with the call's JSON arguments, in a thread of its own
  within ``tool_timeout_s`` (``FunctionTools``); a coroutine is run to its end there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import json
from collections.abc import Callable
from typing import Any

from ..rewards.vf_v1 import V1Taskset
from .chat_tools import FunctionTools


def _run(coro):
    """``coro`` to its end, in a fresh event loop (in a thread of its own when one is running here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with cf.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _server_class():
    try:  # mcp 2.x (verifiers 0.4)
        from mcp.server.mcpserver import MCPServer
        return MCPServer
    except ImportError:  # mcp 1.x (verifiers 0.3.1's verifiers.v1)
        from mcp.server.fastmcp import FastMCP
        return FastMCP


def advertised(toolset) -> list[tuple[str, str, dict]]:
    """``(name the model calls, method name, OpenAI function schema)`` of each ``@vf.tool`` of
    ``toolset``, as its MCP server advertises them."""
    from verifiers.v1.utils.decorators import discover_decorated

    server = _server_class()(toolset.server_name or type(toolset).__name__)
    toolset.register(server)
    listed = {t.name: t for t in _run(server.list_tools())}
    out = []
    for fn in discover_decorated(toolset, "tool"):
        raw = getattr(fn, "tool_name", None) or fn.__name__
        tool = listed[raw]
        name = f"{toolset.server_name}_{raw}" if toolset.server_name else raw
        parameters = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None) or {}
        out.append((name, fn.__name__, {"type": "function", "function": {
            "name": name, "description": tool.description or "", "parameters": parameters}}))
    return out


class V1RolloutTools(FunctionTools):
    """One rollout's tools, and its state (what ``rollout_info`` hands the rewards)."""

    def __init__(self, functions: dict[str, Callable], timeout_s: float, schemas: dict, state):
        super().__init__(functions, timeout_s, schemas)
        self.state = state

    def rollout_info(self) -> dict[str, Any]:
        return {"vf_state": json.loads(self.state.model_dump_json())}


class V1Tools:
    """The per-rollout tools of a ``V1Taskset`` (``ChatToolEnv.per_rollout``): ``schemas`` for the
    template, ``tools(prompt, ...)`` for a rollout of the task that prompt was rendered from."""

    def __init__(self, taskset: V1Taskset):
        self.taskset, self.template = taskset, None
        self.by_prompt = {_key(row["prompt"]): task for row, task in zip(taskset.build_dataset(), taskset.tasks)}
        self.schemas, seen = [], set()
        try:
            for toolset in taskset.toolsets_of(taskset.tasks[0]):
                for name, _, schema in advertised(toolset):
                    if name in seen:
                        raise ValueError(f"two tools are named {name!r} (keep MCP tool names qualified)")
                    seen.add(name)
                    self.schemas.append(schema)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - a toolset's own code, or a signature MCP cannot describe
            raise ValueError(f"{taskset.what}: its toolsets' tools cannot be listed ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]})") from None
        self._shared_ready = False
        self._names: dict[type, list[tuple[str, str]]] = {}  # a toolset class -> (name called, method name)

    def bind(self, template) -> None:
        self.template = template

    def _task(self, prompt: str | None):
        question = (getattr(self.template, "rendered", None) or {}).get(prompt)
        task = self.by_prompt.get(_key(question)) if isinstance(question, list) else None
        if task is None:
            raise ValueError(f"{self.taskset.what}: a prompt that is not one of the taskset's tasks (the run's "
                             "prompts must be rendered by its chat template from the taskset's rows)")
        return task

    def tools(self, prompt: str | None, functions: dict[str, Callable], timeout_s: float,
              schemas: dict) -> V1RolloutTools:
        """The tools of one rollout of the task ``prompt`` was rendered from: fresh task toolsets, set up
        for it, and the shared ones, each call seeing this rollout's state."""
        task = self._task(prompt)
        state = self.taskset.new_state(task)
        own = self.taskset.toolsets_of(task, shared=False)
        for toolset in own:
            _run(_set_up(toolset, task))
        if not self._shared_ready:
            for toolset in self.taskset.shared_toolsets:
                _run(toolset.setup())
            self._shared_ready = True
        functions = dict(functions)
        for toolset in own + self.taskset.shared_toolsets:
            if type(toolset) not in self._names:
                self._names[type(toolset)] = [(name, method) for name, method, _ in advertised(toolset)]
            for name, method in self._names[type(toolset)]:
                functions[name] = _with_state(getattr(toolset, method), state)
        return V1RolloutTools(functions, timeout_s, schemas, state)


async def _set_up(toolset, task) -> None:
    await toolset.setup()
    await toolset.setup_task(task)


def _with_state(fn: Callable, state) -> Callable:
    """``fn`` called with ``state`` as its toolset's ``self.state`` (verifiers' per-call context
    variable), a coroutine run to its end in the calling thread."""
    from verifiers.v1.mcp.server import _call_state

    def call(**arguments):
        token = _call_state.set(state)
        try:
            result = fn(**arguments)
            return asyncio.run(result) if inspect.isawaitable(result) else result
        finally:
            _call_state.reset(token)

    call.__signature__ = inspect.signature(fn)
    call.__name__ = fn.__name__
    return call


def _key(messages: list[dict]) -> str:
    return json.dumps([[m.get("role"), m.get("content")] for m in messages])
