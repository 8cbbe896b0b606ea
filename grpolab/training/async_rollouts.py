"""Rollouts produced ahead of training by a bounded number of policy versions (``max_staleness``):
the machinery of asynchronous RL, kept apart from the algorithm that consumes the batches.

Policy version ``v`` is the weights after ``v`` outer steps. With ``max_staleness`` k, rollout
batch ``b`` is generated under version ``max(v0, b - k)`` exactly (``v0``: the version the sampler
started with — 0, or the step a run resumed at), by a producer thread that calls ``produce(b)``
(sample and score one batch) on a backend with its own weights (a sampler process, a vLLM
server). Training step ``s`` consumes batch ``s`` with the weights of version ``s``, so each batch's
staleness is ``s - version <= k`` (k once the run is k steps in). A fixed schedule rather than
"the newest weights there are": a run is reproducible and resumes exactly, and on two cores it
loses nothing, since whichever side is slower never waits (see ``publish``).

Weights move through one staging slot: after step ``v - 1`` the trainer ``publish``es version
``v`` (streamed into the backend's staging copy), waiting first until the producer has loaded
version ``v - 1``; the producer loads version ``b - k`` (``backend.load_staged``) just before it
starts batch ``b``. Every response therefore has one version for all its tokens (the
``policy_version`` of ``Rollout.info``): an update never lands in the middle of a response.

What was in flight is kept, not dropped: a checkpoint after step ``s`` waits for the batches
``s + 1 .. s + k`` (they need versions ``<= s``, all published) and saves them with the data
position after their prompts (``state_dict``); a resumed run trains on them first and then
generates batch ``s + k + 1`` onward under version ``s + 1`` — the batches and versions the
uninterrupted run had. ``data_position`` is the position after the last *consumed* batch, which a
synchronous resume (``max_staleness: 0``) of the same checkpoint uses: it regenerates them.

Figures per step: ``async/staleness_mean`` and ``async/staleness_max`` (over the batch's
responses), ``time/trainer_wait_s`` (the trainer waiting for a batch, or for the slot) and
``time/sampler_wait_s`` (the producer waiting for the version of the step's batch before it began it).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..rollout import WeightSyncError


@dataclass
class Produced:
    """One rollout batch from the producer: what ``produce`` returned, the policy version it was
    sampled under, the data sampler's state after its prompts were drawn, and the seconds the
    producer waited for that version."""

    index: int
    item: Any
    version: int
    data_after: dict
    sampler_wait_s: float = 0.0
    extra: dict = field(default_factory=dict)


class AsyncRollouts:
    """The producer thread and the version hand-off (module doc).

    ``produce(b) -> item`` samples and scores batch ``b`` (called in the producer thread, after the
    backend holds the batch's version and ``reseed(b)`` was called); ``data`` is the data sampler
    (``state_dict`` taken after each batch, ``load_state_dict`` on resume); ``encode``/``decode`` turn
    an item into plain checkpoint state and back. ``start(first)`` begins producing at batch ``first``; ``get(s)``
    returns batch ``s`` (a ``Produced``); ``publish(v, weights)`` hands version ``v`` over."""

    def __init__(self, backend, max_staleness: int, produce: Callable[[int], Any], data,
                 encode: Callable[[Any], Any], decode: Callable[[Any], Any], reseed: Callable[[int], None]):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for asynchronous rollouts, got {max_staleness}")
        self.backend, self.k = backend, max_staleness
        self._produce, self._data, self._encode, self._decode = produce, data, encode, decode
        self._reseed = reseed
        self._cond = threading.Condition()
        self._ready: dict[int, Produced] = {}
        self._restored: list[Produced] = []
        self._staged: int | None = None  # the version in the staging slot, not yet loaded
        self._loaded = 0  # the version the backend samples with
        self._published = 0
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._wait_since_taken = 0.0
        self.consumed_data: dict | None = None  # the data position after the last consumed batch

    # ---------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict:
        """The batches after the last consumed one that the schedule had fixed (waited for: they
        need only published versions), plain, with the data position after them."""
        if self._thread is None:
            return {"in_flight": [], "data_after": self.consumed_data}
        last = min(self._consumed + self.k, self._total - 1)
        with self._cond:
            self._wait(lambda: all(b in self._ready for b in range(self._consumed + 1, last + 1)), "checkpoint")
            batches = [self._ready[b] for b in range(self._consumed + 1, last + 1)]
        return {"in_flight": [{"index": p.index, "version": p.version, "item": self._encode(p.item),
                               "data_after": p.data_after} for p in batches],
                "data_after": batches[-1].data_after if batches else self.consumed_data}

    def load_state_dict(self, state: dict) -> None:
        self._restored = [Produced(int(p["index"]), self._decode(p["item"]), int(p["version"]), p["data_after"])
                          for p in state.get("in_flight", [])]
        self.consumed_data = None

    # ---------------------------------------------------------------- the producer
    def start(self, first: int, total: int) -> None:
        """Produce batches ``first`` .. ``total - 1`` (the sampler holds version ``first``); restored
        in-flight batches that continue from ``first`` are used as they are, the rest regenerated."""
        self._v0 = self._loaded = self._published = first
        self._consumed, self._total = first - 1, total
        restored = [p for p in self._restored if p.index >= first]
        keep = []
        for p in sorted(restored, key=lambda p: p.index):
            if p.index == first + len(keep):
                keep.append(p)
        for p in keep:
            self._ready[p.index] = p
        self._next = first + len(keep)
        if keep:  # the prompts after the kept batches come next
            self._data.load_state_dict(keep[-1].data_after)
        self._thread = threading.Thread(target=self._run, name="grpolab-rollouts", daemon=True)
        self._thread.start()

    def version_of(self, b: int) -> int:
        return max(self._v0, b - self.k)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop or self._next >= self._total:
                        return
                    b = self._next
                    need = self.version_of(b)
                    t0 = time.perf_counter()
                    self._wait(lambda: self._loaded >= need or self._staged == need, "the policy version",
                               producer=True)
                    waited = time.perf_counter() - t0
                    if self._stop:
                        return
                load = self._loaded < need
                if load:
                    try:
                        self.backend.load_staged()
                    except WeightSyncError as exc:  # the sync canary: name the step whose weights did not arrive
                        raise WeightSyncError(f"step {need - 1} (policy version {need}): {exc}") from None
                with self._cond:
                    if load:
                        self._loaded, self._staged = need, None
                        self._cond.notify_all()
                self._reseed(b)
                item = self._produce(b)
                produced = Produced(b, item, need, self._data.state_dict(), waited)
                with self._cond:
                    self._ready[b] = produced
                    self._next = b + 1
                    self._cond.notify_all()
        except BaseException as exc:  # the trainer re-raises it at its next wait
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str, producer: bool = False) -> None:
        """Wait on the condition (held) until ``ready()``; the producer's error (or a stop) ends it."""
        while not ready():
            if self._stop and producer:
                return
            if self._error is not None and not producer:
                raise self._error
            if not producer and self._thread is not None and not self._thread.is_alive() and not ready():
                raise RuntimeError(f"the rollout producer stopped while the trainer waited for {what}")
            self._cond.wait(0.5)

    # ---------------------------------------------------------------- the trainer's side
    def get(self, s: int) -> Produced:
        """Batch ``s``, waiting for it; its ``trainer_wait_s`` and the producer's wait are in ``extra``."""
        t0 = time.perf_counter()
        with self._cond:
            self._wait(lambda: s in self._ready, f"rollout batch {s}")
            produced = self._ready.pop(s)
            self._consumed = s
            self.consumed_data = produced.data_after
            self._cond.notify_all()
        produced.extra["trainer_wait_s"] = time.perf_counter() - t0
        return produced

    def publish(self, version: int, weights) -> float:
        """Stage version ``version`` (after the step that made it) once the slot is free; returns the
        seconds waited for the slot. A version no batch will use (past the last) is skipped."""
        if version + self.k >= self._total or version <= self._published:
            self._published = max(self._published, version)
            for _ in weights:  # a collective stream (sharded weights): every rank reads it to the end
                pass
            return 0.0
        t0 = time.perf_counter()
        with self._cond:
            self._wait(lambda: self._staged is None and self._loaded >= version - 1, "the staging slot")
        waited = time.perf_counter() - t0
        self.backend.stage(weights)
        with self._cond:
            self._staged, self._published = version, version
            self._cond.notify_all()
        return waited

    def limit(self, total: int) -> None:
        """The run ends after ``total`` batches (a sample budget spent): produce none past it."""
        with self._cond:
            self._total = min(self._total, total)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop producing (the batch being generated is abandoned with the backend)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def join(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
