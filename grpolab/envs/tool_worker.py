"""Child side of the supervised tool worker; run as ``python -I tool_worker.py`` by
``custom.ToolPool`` (the reward workers' pool, ``grpolab.rewards.supervisor``), never imported by
the trainer.

The protocol is the reward worker's: length-prefixed pickle frames in (first
``{"sys_path", "spec": {"tool": "pkg.mod:fn"}}``, then batches of ``(query, None)``; a dict query
is a function call's arguments, ``fn(**query)``), one JSON line out per message:
``["ready"]``/``["fatal", msg]``, then ``["ok", {"text": str}]`` or ``["err", msg]`` per query,
flushed one by one so a hang or a crash is charged to its own call.
"""

import importlib
import json
import sys
from pathlib import Path

# -I leaves the checkout off sys.path: find grpolab after the installed packages (never before them)
sys.path.append(str(Path(__file__).resolve().parents[2]))

from grpolab.rewards.reward_worker import serve


def _load_tool(spec):
    # resolved here rather than through grpolab.envs, whose package imports torch: a worker starts in
    # a fraction of a second (the parent already checked the name with custom.resolve_tool)
    module_name, _, attr = spec["tool"].partition(":")
    tool_fn = getattr(importlib.import_module(module_name), attr)

    def handle(query, _unused):
        if isinstance(query, dict):  # native function calling: the call's arguments; any JSON-able result
            text = tool_fn(**query)
            return {"text": text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, default=str)}
        text = tool_fn(query)
        if not isinstance(text, str):
            raise TypeError(f"tool returned {type(text).__name__}, not str")
        return {"text": text}

    return handle


def main() -> None:  # pragma: no cover - runs in the child process
    serve(_load_tool)


if __name__ == "__main__":
    main()
