"""Child side of the supervised tool worker; run as ``python -I tool_worker.py`` by
``custom.ToolPool`` (the reward workers' pool, ``grpolab.rewards.supervisor``), never imported by
the trainer.

The protocol is the reward worker's: length-prefixed pickle frames in (first
``{"sys_path", "spec": {"tool": "pkg.mod:fn"}}``, then batches of ``(query, None)``), one JSON line
out per message: ``["ready"]``/``["fatal", msg]``, then ``["ok", {"text": str}]`` or
``["err", msg]`` per query, flushed one by one so a hang or a crash is charged to its own call.
"""

import importlib
import json
import os
import sys
import threading
from pathlib import Path

# -I leaves the checkout off sys.path: find grpolab after the installed packages (never before them)
sys.path.append(str(Path(__file__).resolve().parents[2]))

from grpolab.rewards.reward_worker import read_frame, watch_parent


def main() -> None:  # pragma: no cover - runs in the child process
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)  # a tool's print() goes to the trainer's stderr, not into the protocol
    sys.stdout = sys.stderr
    threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()

    def send(message) -> None:
        proto_out.write(json.dumps(message) + "\n")
        proto_out.flush()

    hello = read_frame(proto_in)
    if hello is None:
        return
    sys.path[:] = hello["sys_path"]
    try:
        # resolved here rather than through grpolab.envs, whose package imports torch: a worker starts in
        # a fraction of a second (the parent already checked the name with custom.resolve_tool)
        module_name, _, attr = hello["spec"]["tool"].partition(":")
        tool_fn = getattr(importlib.import_module(module_name), attr)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        send(["fatal", f"{type(exc).__name__}: {exc}"])
        return
    send(["ready"])
    while True:
        batch = read_frame(proto_in)
        if batch is None:
            return
        for query, _ in batch:
            try:
                text = tool_fn(query)
                if not isinstance(text, str):
                    raise TypeError(f"tool returned {type(text).__name__}, not str")
                message = ["ok", {"text": text}]
            except BaseException as exc:  # noqa: BLE001 - SystemExit from a tool is an error too
                message = ["err", f"{type(exc).__name__}: {exc}"]
            send(message)


if __name__ == "__main__":
    main()
