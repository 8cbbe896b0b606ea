"""The Hugging Face backend in a sampler process of its own: one process generates with its own
copy of the weights while the trainer's process trains (``max_staleness >= 1``, no vLLM needed).

Weights move through shared memory. The parent keeps a *staging* copy of the sampling model whose
tensors live in shared memory (``share_memory()``); the child process is sent that module through
its pipe once started (torch's multiprocessing passes shared tensors by handle, nothing is copied;
not in the spawn payload, whose write blocks for good when the child dies reading it) and builds its
own private *live* copy, which its ``HFRolloutBackend`` samples from. A weight update is two steps
so that the trainer never waits on a generation in progress:

- ``stage(weights)`` (the trainer's process): copy the streamed (name, tensor) pairs into the
  staging tensors, one at a time — a stream gathered from FSDP2 shards is never held whole;
- ``load_staged()`` (asked of the child, between two generate calls): copy staging into live.

``sync_weights`` does both (the synchronous use). The child runs ``threads`` torch threads (1: one
core generates while the trainer's threads train). Every call checks that the child is alive while
it waits: a sampler process that dies is one line (``SamplerProcessError``) with its exit code,
never a hang. Errors raised in the child (a bad prompt) are re-raised in the parent as they were.

The staging copy costs one model's weights in shared memory (``/dev/shm``), the child's live copy
another; on a GPU the child's live copy sits on ``device`` and staging stays on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import sys
import threading
from typing import Iterable, Sequence

import torch

from .base import (
    Rollout,
    RolloutBackendError,
    SamplingParams,
    WeightSyncError,
    model_end_ids,
    sync_problem,
    tensor_sums,
)
from .hf import HFRolloutBackend


@contextlib.contextmanager
def _main_module_hidden():
    """Start a spawned child without it importing the caller's ``__main__`` (a script without an
    ``if __name__ == "__main__"`` guard would run again in it): the child needs grpolab's modules only."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for key in saved:
            if key == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[key]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


class SamplerProcessError(RolloutBackendError):
    """The sampler process died or could not start; the message is one line."""


@contextlib.contextmanager
def _terminal_signals_ignored():
    """Start a child with SIGINT and SIGTERM ignored (kept across its exec; Python leaves an ignored
    SIGINT ignored): a terminal's Ctrl-C or a scheduler's SIGTERM goes to the whole process group,
    and the trainer, which checkpoints on them, must find its sampler alive; it ends the child itself
    (``close``). The main thread only (elsewhere the child ignores them from its first line)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _serve(conn, options: dict) -> None:
    """The child: build the live copy and an HF backend on it, then answer commands until ``close``
    (or its parent's end). Ctrl-C and SIGTERM are the trainer's to handle (reliability case A09)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(options["threads"])
    os.environ["OMP_NUM_THREADS"] = str(options["threads"])
    try:
        # the weights (shared memory, by handle) and the tokenizer come through the pipe, not the spawn
        # payload: CPython writes that whole before it sees the child die (a blocked write, C5-2); a
        # message is read whole, then unpickled here, so its failure is one line to the parent
        staging, tokenizer = conn.recv()
    except EOFError:
        return
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        conn.send(("error", SamplerProcessError(f"the sampler process could not start: the model or tokenizer "
                                                f"did not unpickle in it ({type(exc).__name__}: {first})")))
        return
    try:
        live = copy.deepcopy(staging).to(options["device"]).eval()  # private memory, not the shared staging
        generator = torch.Generator().manual_seed(options["seed"])
        backend = HFRolloutBackend(live, tokenizer, max_batch_size=options["max_batch_size"],
                                   autocast_dtype=options["autocast_dtype"], generator=generator,
                                   fast_path=options["fast_path"])
        pairs = list(zip(live.state_dict().values(), staging.state_dict().values()))
    except Exception as exc:  # the parent reports it in one line
        conn.send(("error", exc))
        return
    conn.send(("ok", None))
    while True:
        try:
            command, args = conn.recv()
        except EOFError:  # the parent went away
            return
        try:
            if command == "generate":
                out = backend.generate(*args)
            elif command == "load":
                with torch.no_grad():
                    for live_t, staged in pairs:
                        live_t.copy_(staged)
                out = _held_sums(live) if options.get("check_sync") else None
            elif command == "seed":
                generator.manual_seed(int(args[0]))
                out = None
            elif command == "close":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown sampler command {command!r}")
            conn.send(("ok", out))
        except Exception as exc:
            conn.send(("error", exc))


def _held_sums(model) -> tuple[dict, list[list[str]]]:
    """The sync canary's read-back: each state-dict tensor's ``tensor_sums`` and the names sharing one
    tensor (tied weights)."""
    held, by_ptr = {}, {}
    for name, t in model.state_dict().items():
        held[name] = tensor_sums(t)
        by_ptr.setdefault((t.data_ptr(), tuple(t.shape)), []).append(name)
    return held, list(by_ptr.values())


class ProcessRolloutBackend:
    """``generate(prompts, n, sampling)`` in a sampler process with its own weights (see the module
    doc); ``stage``/``load_staged`` (or ``sync_weights``) move new weights to it. ``seed`` seeds the
    child's generator; ``reseed(seed)`` re-seeds it (the async loop seeds each rollout batch).
    ``check_sync`` (the sync canary): each ``load_staged`` reads back the sums of every tensor the
    child samples with and compares them with what ``stage`` was sent (``WeightSyncError`` when a
    tensor was not sent or differs)."""

    def __init__(self, model, tokenizer, *, threads: int = 1, max_batch_size: int = 256, autocast_dtype=None,
                 fast_path: bool = True, seed: int = 0, device: str | None = None, check_sync: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.check_sync, self._expected = check_sync, {}
        device = device or str(next(model.parameters()).device)
        self.staging = copy.deepcopy(model).cpu().eval().requires_grad_(False).share_memory()
        self._staged = self.staging.state_dict()
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        options = dict(threads=threads, max_batch_size=max_batch_size, autocast_dtype=autocast_dtype,
                       fast_path=fast_path, seed=seed, device=device, check_sync=check_sync)
        self.process = ctx.Process(target=_serve, args=(child, options), daemon=True, name="grpolab-sampler")
        with _main_module_hidden(), _terminal_signals_ignored():
            self.process.start()
        child.close()
        self._closed = False
        self._lock = threading.Lock()  # one call on the pipe at a time (a producer thread and the trainer's)
        try:
            self._conn.send((self.staging, tokenizer))  # fails (never blocks) when the child died
        except (BrokenPipeError, ConnectionError, OSError):
            pass  # _receive says how it ended
        self._receive("start")

    # ---------------------------------------------------------------- the child
    def _receive(self, what: str):
        try:
            while not self._conn.poll(0.2):
                if not self.process.is_alive():
                    break
            status, value = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(1)
            raise SamplerProcessError(f"the sampler process died during {what} (exit code "
                                      f"{self.process.exitcode}); a resumed run starts a new one") from None
        if status == "error":
            raise value
        return value

    def _call(self, command: str, *args):
        with self._lock:
            if self._closed:
                raise SamplerProcessError("the sampler process was closed")
            try:
                self._conn.send((command, args))
            except (BrokenPipeError, OSError):
                raise SamplerProcessError(f"the sampler process died (exit code {self.process.exitcode}) "
                                          f"before {command}") from None
            return self._receive(command)

    # ---------------------------------------------------------------- the interface
    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams,
                 prompt_ids: Sequence[list[int]] | None = None) -> list[Rollout]:
        return self._call("generate", list(prompts), n, sampling,
                          None if prompt_ids is None else [list(p) for p in prompt_ids])

    def stage(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy streamed (name, tensor) pairs into the staging weights (the child is not reading them:
        ``load_staged`` is the only reader, and the caller orders the two). A name the sampling model
        does not have is an error; tied weights may come under either name."""
        with torch.no_grad():
            for name, value in weights:
                target = self._staged.get(name)
                if target is None:
                    raise KeyError(f"weight {name!r} is not in the sampler's model")
                value = value.detach().to(target.device, target.dtype)
                target.copy_(value)
                if self.check_sync:
                    self._expected[name] = tensor_sums(value)

    def load_staged(self) -> None:
        """The child copies the staging weights into the ones it samples with; with ``check_sync``,
        its weights are compared with what was staged (``WeightSyncError``)."""
        held = self._call("load")
        expected, self._expected = self._expected, {}
        if held is not None:
            problem = sync_problem(expected, *held)
            if problem:
                raise WeightSyncError(f"sync canary: the sampler process's weights are not the trainer's after the "
                                      f"weight sync: {problem}")

    def sync_weights(self, model, weights=None) -> None:
        """Stage ``weights`` (default: ``model``'s state dict) and load them: the next generate uses them."""
        self.stage(weights if weights is not None else model.state_dict().items())
        self.load_staged()

    def reseed(self, seed: int) -> None:
        self._call("seed", seed)

    def end_ids(self) -> list[int]:
        return model_end_ids(self.model, self.tokenizer)

    def close(self) -> None:
        """Stop the child: asked to, when no call is in progress (else, after 5 s, killed, which ends
        that call with an error); safe to call twice."""
        if self._closed:
            return
        idle = self._lock.acquire(timeout=5)
        try:
            if idle and self.process.is_alive():
                self._conn.send(("close", ()))
                if self._conn.poll(10):
                    self._conn.recv()
        except (BrokenPipeError, OSError, EOFError):
            pass
        finally:
            self._closed = True
            if not idle or self.process.is_alive():
                self.process.join(0 if not idle else 10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
            if idle:
                self._lock.release()
