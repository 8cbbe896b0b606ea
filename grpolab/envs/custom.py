"""Custom tools: ``"mypackage.tools:my_tool"`` names a function

    def my_tool(query: str) -> str

that receives the text between the tool's tags and returns the text the model will see (tags in it
are removed). It may raise or hang: every exception, a non-``str`` result, a run past
``timeout_s`` and a dead worker become an error observation (``<result>error: ...</result>``,
counted in ``tool_errors``), never a crash and never a stalled rollout.

Where it runs. A function named ``module:function`` (or a module-level function, which is named
the same way) runs in a supervised worker *process*: the reward workers' pool
(``grpolab.rewards.supervisor.WorkerPool``) with a tool-side child script, so a tool that hangs is
killed at the timeout and replaced, and one that calls ``os._exit`` or segfaults costs one call;
its address space is capped (``memory_limit_mb``, the env's ``worker_memory_limit_mb``), so one
that allocates without bound fails its call instead of taking the machine's memory.
A thread cannot give that: a hung thread can only be abandoned (it keeps its core), and a crash in
it ends the trainer. A callable that cannot be named (a lambda, a closure) runs in a thread with
the same timeout, and a warning says what is lost.
"""

from __future__ import annotations

import concurrent.futures as cf
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from ..rewards.isolation import child_sys_path
from ..rewards.registry import import_callable, reward_spec
from ..rewards.supervisor import DEFAULT_MEMORY_LIMIT_MB, RewardWorker, WorkerPool, WorkerStartError, take_idle
from .base import ToolOutput

ToolFn = Callable[[str], str]


def resolve_tool(spec: str) -> ToolFn:
    """The function named by ``"package.module:function"``; one-line ``ValueError`` otherwise."""
    return import_callable(spec, "custom tool")


class ToolWorker(RewardWorker):
    """A reward worker process running the tool-side child script instead."""

    SCRIPT = Path(__file__).with_name("tool_worker.py")


class ToolPool(WorkerPool):
    """The reward workers' pool (dispatch, per-item timeout, restart, give-up) with tool workers.
    The spec is ``{"tool": name}``, so an idle tool worker is never handed to a reward scorer."""

    def __init__(self, spec: dict, sys_path: list[str], n: int, memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB):
        self.workers = [take_idle(spec, sys_path, memory_limit_mb) or ToolWorker(spec, sys_path, memory_limit_mb)
                        for _ in range(max(1, n))]
        self.restarts = 0


class CustomTool:
    """A user's ``query -> str`` function as a tool (see the module docstring).

    ``errors``/``timeouts`` count failed calls; ``mode`` is ``"process"`` or ``"thread"``."""

    def __init__(self, fn: str | ToolFn, name: str | None = None, timeout_s: float = 10.0, num_workers: int = 1,
                 max_restarts: int = 8, memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB):
        self.fn = resolve_tool(fn) if isinstance(fn, str) else fn
        if not callable(self.fn):
            raise ValueError(f"custom tool {fn!r} is not callable")
        self.name = name or getattr(self.fn, "__name__", "tool")
        if timeout_s <= 0:
            raise ValueError(f"custom tool {self.name!r}: timeout_s must be > 0 (a tool may hang)")
        self.timeout_s, self.num_workers, self.max_restarts = timeout_s, num_workers, max_restarts
        self.memory_limit_mb = memory_limit_mb
        self.errors = self.timeouts = 0
        self._spec = fn if isinstance(fn, str) else reward_spec(self.fn)
        self._pool: ToolPool | None = None
        self._threads: cf.ThreadPoolExecutor | None = None
        self.mode = "process" if isinstance(self._spec, str) and ":" in self._spec else "thread"
        if self.mode == "thread":
            warnings.warn(f"custom tool {self.name!r} cannot be named as 'module:function', so it runs in a thread: a "
                          "call past the timeout is abandoned (it keeps running), and a crash ends the process",
                          RuntimeWarning, stacklevel=2)

    def run(self, queries: Sequence[str]) -> list[ToolOutput]:
        if not queries:
            return []
        if self.mode == "process":
            try:
                return self._run_in_workers(queries)
            except WorkerStartError as exc:
                return [self._failed(f"the tool worker could not start ({exc})") for _ in queries]
        return [self._run_in_thread(q) for q in queries]

    def _failed(self, message: str) -> ToolOutput:
        self.errors += 1
        if message.startswith("timed out"):
            self.timeouts += 1
        return ToolOutput("", message)

    def _run_in_workers(self, queries: Sequence[str]) -> list[ToolOutput]:
        if self._pool is None:
            self._pool = ToolPool({"tool": self._spec}, child_sys_path(cwd_last=True), self.num_workers,
                                  self.memory_limit_mb)
        results = self._pool.run([(q, None) for q in queries], self.timeout_s, self.max_restarts)
        return [ToolOutput(r["text"]) if isinstance(r, dict) else self._failed(str(r)) for r in results]

    def _run_in_thread(self, query: str) -> ToolOutput:
        if self._threads is None:
            self._threads = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tool-{self.name}")
        future = self._threads.submit(self.fn, query)
        try:
            text = future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            # the hung thread keeps its executor: abandon both, start a fresh one for the next call
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
            return self._failed(f"timed out after {self.timeout_s}s")
        except Exception as exc:  # noqa: BLE001 - any tool failure is an observation
            return self._failed(f"{type(exc).__name__}: {exc}")
        if not isinstance(text, str):
            return self._failed(f"tool returned {type(text).__name__}, not str")
        return ToolOutput(text)

    def close(self) -> None:
        """Hand live workers back for reuse and stop the thread pool."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
