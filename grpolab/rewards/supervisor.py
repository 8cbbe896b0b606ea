"""Parent side of the supervised reward workers: persistent child processes that run a user's
reward so that a hang, an ``os._exit`` or a segfault costs one sample, not the training run.

Why processes and not threads: a thread that never returns cannot be stopped (it keeps its core and
its memory), and ``os._exit``/a segfault in a thread ends the whole trainer. A child process can be
killed after the timeout and replaced, and its death is visible as an exit code or signal.

Why persistent and batched: starting Python and importing the user's module costs tens to hundreds
of milliseconds; a batch is sent in one write and the worker streams one result per item back, so
the per-response overhead is a pickle and a JSON line (see ``benchmarks/grading.py``). Results come
back one by one so that a timeout or a crash is charged to exactly the item being scored; the rest
of the batch is re-sent to a fresh worker. Idle workers of a closed scorer are kept (a few, keyed
by reward and path) for the next scorer of the same reward: ``grpolab eval`` makes one per call.

Bounded. A worker's address space is limited (``memory_limit_mb``, ``RLIMIT_AS`` set in the child
before the user's module is imported): an allocation past it fails that call (a ``MemoryError``,
or the worker's death), counted as an error like any other. The parent reads worker output in
linear time (a bytearray; each complete line is split out once), so a huge result costs its size,
not its size squared.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import select
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from .isolation import child_command, describe_exit

HEADER_SIZE = 8
READ_SIZE = 1 << 20
DEFAULT_MEMORY_LIMIT_MB = 4096  # address space of a worker: a runaway reward or tool fails its call, not the machine
STARTUP_TIMEOUT_S = 120.0  # importing a user's module may import torch: not part of any item's time
MAX_IDLE_WORKERS = 4


class WorkerStartError(RuntimeError):
    """The worker did not come up. ``unresolvable``: it started but could not build the reward
    (an import that works in the trainer and not in the isolated child) — the scorer falls back."""

    def __init__(self, message: str, unresolvable: bool = False):
        super().__init__(message)
        self.unresolvable = unresolvable


class UnsendableInputs(ValueError):
    """A batch holds a ground truth that pickle cannot send (the scorer grades it in-process)."""


class RewardWorker:
    """One child process running ``reward_worker.py`` for one reward spec."""

    SCRIPT = Path(__file__).with_name("reward_worker.py")

    def __init__(self, spec: Any, sys_path: list[str], memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB):
        self.spec, self.sys_path, self.memory_limit_mb = spec, list(sys_path), memory_limit_mb
        self.proc: subprocess.Popen | None = None
        self._buffer = bytearray()

    @property
    def key(self) -> str:
        return worker_key(self.spec, self.sys_path, self.memory_limit_mb)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the child and wait for it to import the reward; raises ``WorkerStartError``."""
        self.kill()
        # its own session and process group: a terminal's Ctrl-C (sent to the trainer's group) leaves it
        # to finish its batch while the trainer checkpoints; ``kill`` ends its whole group (case V08)
        self.proc = subprocess.Popen(child_command(self.SCRIPT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0, start_new_session=True)
        try:
            self.send_frame({"sys_path": self.sys_path, "spec": self.spec, "memory_limit_mb": self.memory_limit_mb})
        except OSError:
            pass  # it died at once: reported below from its exit status
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            messages = self.read(max(0.0, deadline - time.monotonic()))
            if messages is None:
                self.proc.wait()
                raise WorkerStartError(f"reward worker died while starting ({self.exit_description()})")
            if messages:
                kind = messages[0]
                if kind[0] == "ready":
                    return
                self.kill()
                raise WorkerStartError(f"reward worker could not load the reward: {kind[1]}", unresolvable=True)
            if time.monotonic() >= deadline:
                self.kill()
                raise WorkerStartError(f"reward worker did not start within {STARTUP_TIMEOUT_S:.0f}s")

    def send_frame(self, obj: Any) -> None:
        try:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise UnsendableInputs(f"{type(exc).__name__}: {exc}") from None
        self.proc.stdin.write(len(payload).to_bytes(HEADER_SIZE, "little") + payload)
        self.proc.stdin.flush()

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def read(self, timeout: float | None) -> list | None:
        """The complete messages available within ``timeout`` ([] if none), None at end of output."""
        ready, _, _ = select.select([self.fileno()], [], [], timeout)
        if not ready:
            return []
        chunk = os.read(self.fileno(), READ_SIZE)
        if not chunk:
            return None
        self._buffer += chunk  # amortised O(len(chunk)): never a copy of everything read so far
        if b"\n" not in chunk:
            return []
        *lines, rest = bytes(self._buffer).split(b"\n")
        self._buffer = bytearray(rest)
        return [json.loads(line) for line in lines if line]

    def exit_description(self) -> str:
        return describe_exit(self.proc.poll() if self.proc is not None else None)

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:  # not reaped yet: its group id is still its own
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except OSError:
                    self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        self.proc, self._buffer = None, bytearray()


class WorkerPool:
    """``n`` workers for one reward; ``run`` scores a batch split into contiguous chunks."""

    def __init__(self, spec: Any, sys_path: list[str], n: int,
                 memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB):
        self.workers = [take_idle(spec, sys_path, memory_limit_mb) or RewardWorker(spec, sys_path, memory_limit_mb)
                        for _ in range(max(1, n))]
        self.restarts = 0

    def run(self, items: list[tuple[str, Any]], timeout_s: float | None, max_restarts: int) -> list[Any]:
        """One entry per item: a score dict, or an error message string. Raises ``WorkerStartError``
        only when the reward cannot be loaded in a worker at all (the caller falls back).

        Long on purpose: dispatch, restart and give-up share the batch's queues and restart count,
        and reading them as closures over one batch is clearer than a class of their own."""
        results: list[Any] = [None] * len(items)
        if not items:
            return results
        k = min(len(self.workers), len(items))
        bounds = [round(i * len(items) / k) for i in range(k + 1)]
        queues = {w: deque(range(bounds[i], bounds[i + 1])) for i, w in enumerate(self.workers[:k])}
        deadlines: dict[RewardWorker, float] = {}
        restarts = 0

        def dispatch(worker: RewardWorker) -> None:
            nonlocal restarts
            queue = queues[worker]
            while queue:
                try:
                    if not worker.alive():
                        worker.start()
                    worker.send_frame([items[i] for i in queue])
                    deadlines[worker] = time.monotonic() + (timeout_s or 0)
                    return
                except WorkerStartError as exc:
                    if exc.unresolvable:
                        raise
                    message = str(exc)
                except OSError as exc:  # the pipe broke under the write: the child died
                    worker.kill()
                    message = f"reward worker died ({type(exc).__name__})"
                results[queue.popleft()] = message
                restarts += 1
                if restarts > max_restarts:
                    give_up(worker)

        def give_up(worker: RewardWorker) -> None:
            queue = queues[worker]
            while queue:
                results[queue.popleft()] = (f"not scored: the reward worker was restarted {restarts} times in this "
                                            f"batch (max_restarts={max_restarts})")

        def replace(worker: RewardWorker, message: str) -> None:
            nonlocal restarts
            results[queues[worker].popleft()] = message
            worker.kill()
            restarts += 1
            self.restarts += 1
            if restarts > max_restarts:
                give_up(worker)
            else:
                dispatch(worker)

        try:
            for worker in list(queues):
                dispatch(worker)
            self._collect(queues, deadlines, results, timeout_s, replace)
        except BaseException:
            # an interrupted batch leaves results in flight: no worker may be reused with them
            for worker in self.workers:
                worker.kill()
            raise
        return results

    @staticmethod
    def _collect(queues, deadlines, results, timeout_s, replace) -> None:
        """Read results as they come; charge a timeout or a death to the item being scored."""
        while any(queues.values()):
            busy = [w for w, q in queues.items() if q]
            wait = None if not timeout_s else max(0.0, min(deadlines[w] for w in busy) - time.monotonic())
            ready, _, _ = select.select([w.fileno() for w in busy], [], [], wait)
            for worker in busy:
                if worker.fileno() not in ready:
                    continue
                messages = worker.read(0)
                if messages is None:
                    worker.proc.wait()
                    replace(worker, f"reward worker died ({worker.exit_description()}) while scoring this response")
                    continue
                for kind, value in messages:
                    results[queues[worker].popleft()] = value if kind == "ok" else str(value)
                    deadlines[worker] = time.monotonic() + (timeout_s or 0)
            now = time.monotonic()
            for worker in busy:
                if timeout_s and queues[worker] and now >= deadlines[worker] and worker.fileno() not in ready:
                    replace(worker, f"timed out after {timeout_s}s (the reward worker was killed and restarted)")

    def close(self) -> None:
        """Keep live workers for a later scorer of the same reward; kill the rest."""
        for worker in self.workers:
            if worker.alive():
                _put_idle(worker)
            else:
                worker.kill()
        self.workers = []


_IDLE: list[RewardWorker] = []
_IDLE_LOCK = threading.Lock()


def worker_key(spec: Any, sys_path: list[str], memory_limit_mb: int | None) -> str:
    return json.dumps([spec, list(sys_path), memory_limit_mb])


def take_idle(spec: Any, sys_path: list[str],
              memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB) -> RewardWorker | None:
    """A live idle worker already started for ``spec`` (reused instead of a new process), or None;
    shared with the tool workers of ``grpolab.envs.custom``."""
    key = worker_key(spec, sys_path, memory_limit_mb)
    with _IDLE_LOCK:
        for worker in _IDLE:
            if worker.key == key:
                _IDLE.remove(worker)
                return worker if worker.alive() else None
    return None


def _put_idle(worker: RewardWorker) -> None:
    with _IDLE_LOCK:
        _IDLE.append(worker)
        evicted = _IDLE[:-MAX_IDLE_WORKERS]
        del _IDLE[:-MAX_IDLE_WORKERS]
    for old in evicted:
        old.kill()


def shutdown_idle_workers() -> None:
    """Kill the kept idle workers (at exit, or to start the next scorer from scratch)."""
    with _IDLE_LOCK:
        idle = list(_IDLE)
        _IDLE.clear()
    for worker in idle:
        worker.kill()


atexit.register(shutdown_idle_workers)
