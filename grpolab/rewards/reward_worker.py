"""Child side of the supervised reward worker; run as ``python -I reward_worker.py`` (see
``isolation.py``), never imported by the trainer.

Protocol. stdin carries length-prefixed pickle frames from the parent (the trusted side): first
``{"sys_path": [...], "spec": ...}``, then batches ``[(response, ground_truth), ...]``. stdout
carries one JSON line per message back: ``["ready"]`` or ``["fatal", msg]`` after the hello, then
``["ok", {key: float}]`` or ``["err", msg]`` per item, flushed one by one so that the parent knows
which item a hang or a crash belongs to. JSON on the way back: the parent never unpickles what
user code could have written. The protocol file descriptors are private copies; fd 0 and 1 are
re-pointed to /dev/null and stderr, so a reward that reads stdin or prints cannot corrupt them.

Memory. The hello may carry ``memory_limit_mb``: the worker's address space is limited to it
(``RLIMIT_AS``) before the user's module is imported, so a runaway allocation fails one call (a
``MemoryError`` reported as ``err``) or, at worst, this process, never the trainer.
"""

import json
import os
import pickle
import resource
import struct
import sys
import threading
import time

HEADER = struct.Struct("<Q")


def read_frame(stream):
    """One pickled frame, or None at end of input (the parent closed the pipe or exited)."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    payload = stream.read(size)
    return pickle.loads(payload) if len(payload) == size else None


def watch_parent(parent_pid: int) -> None:
    """End this process when the parent is gone, even if a reward is stuck in a Python loop (a
    parent that was SIGKILLed never closes our stdin while we are busy)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def limit_memory(megabytes) -> None:
    """Cap this process's address space at ``megabytes`` (None: no cap; never raises a cap)."""
    if not megabytes:
        return
    limit = int(megabytes) << 20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):  # pragma: no cover - a platform without RLIMIT_AS
        pass


def serve(load) -> None:  # pragma: no cover - runs in the child process
    """The worker side of the protocol: ``load(spec)`` (called once, after the parent's hello) gives
    ``handle(a, b)``, applied to each item of each batch; every result, exception or ``SystemExit``
    becomes one message. Shared by the reward workers and the tool workers (``grpolab.envs``)."""
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)  # a reward's or tool's print() goes to the trainer's stderr, not into the protocol
    sys.stdout = sys.stderr  # line-buffered: nothing is lost when the worker is killed
    threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()

    def send(message) -> None:
        proto_out.write(json.dumps(message) + "\n")
        proto_out.flush()

    hello = read_frame(proto_in)
    if hello is None:
        return
    sys.path[:] = hello["sys_path"]
    limit_memory(hello.get("memory_limit_mb"))
    try:
        handle = load(hello["spec"])
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which falls back
        send(["fatal", f"{type(exc).__name__}: {exc}"])
        return
    send(["ready"])
    while True:
        batch = read_frame(proto_in)
        if batch is None:
            return
        for a, b in batch:
            try:
                message = ["ok", handle(a, b)]
            except BaseException as exc:  # noqa: BLE001 - SystemExit from a reward is an error too
                message = ["err", f"{type(exc).__name__}: {exc}"]
            send(message)


def _load_reward(spec):
    from grpolab.rewards.registry import build_reward, call_reward, check_reward_output

    reward_fn = build_reward(spec)
    return lambda response, ground_truth: check_reward_output(call_reward(reward_fn, response, ground_truth))


def main() -> None:  # pragma: no cover - runs in the child process
    serve(_load_reward)


if __name__ == "__main__":
    main()
