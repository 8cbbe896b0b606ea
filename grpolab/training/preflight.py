"""Checks that run before a run touches anything: the code a config names is first imported in a
supervised child process.

A ``"pkg.mod:fn"`` reward or custom tool is Python code imported by the trainer itself (to read its
signature) and by its worker processes. A module that blocks at import would hang the run forever,
and one that calls ``os._exit`` (or crashes the interpreter) would end it silently. So each such
module is first imported in a child (``python -I``, the reward worker's ``sys.path``: the working
directory last) with a timeout; a hang or a death is one line naming the module. A module that
merely fails to import (an exception) is left to ``import_callable``'s usual message.

A verifiers environment (``env: {verifiers: ...}``) is loaded the same way first: its
``load_environment`` runs in a supervised child within ``env.load_timeout_s``, so one that never
returns, or ends the process (``os._exit``), is one line and exit 2, not a silent exit 0 (issue 57,
V03 and V07); its exceptions and ``sys.exit`` are left to the trainer's own load, which names them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Iterable

from ..rewards.isolation import child_sys_path, describe_exit
from .config import ConfigError

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_ENV_LOAD_TIMEOUT_S = 120.0  # env.load_timeout_s: verifiers' imports and a dataset build, on a busy host
_OK = "grpolab-import-probe: ok"
_CHILD = (
    "import importlib, json, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "importlib.import_module(sys.argv[2])\n"
    f"sys.stdout.write('\\n{_OK}\\n'); sys.stdout.flush()\n"
)


_ENV_CHILD = (
    "import json, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "from grpolab.rewards.vf_rubric import load_vf_environment\n"
    "try:\n"
    "    load_vf_environment(sys.argv[2], json.loads(sys.argv[3]))\n"
    "except ValueError:\n"
    "    pass  # a failure the trainer's own load reports, in its usual words\n"
    f"sys.stdout.write('\\n{_OK}\\n'); sys.stdout.flush()\n"
)


def import_timeout_s() -> float:
    """``GRPOLAB_IMPORT_TIMEOUT_S`` if set (tests), else 30 s."""
    try:
        return float(os.environ.get("GRPOLAB_IMPORT_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _run_child(code: str, args: list[str], timeout_s: float) -> str | None:
    """``code`` in a fresh isolated interpreter (its own session) with the run's import path and
    ``args``: None if it did not end within ``timeout_s``; "" if it printed ``_OK`` or ended on an
    ordinary exception (the in-process load reports that one); else how the process ended."""
    cmd = [sys.executable, "-I", "-c", code, json.dumps(child_sys_path(cwd_last=True)), *args]
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
                              errors="replace", start_new_session=True)
    except subprocess.TimeoutExpired:
        return None
    if done.stdout.rstrip().endswith(_OK) or (done.returncode == 1 and "Traceback (most recent call last)"
                                               in done.stderr):
        return ""
    return describe_exit(done.returncode)


def probe_import(spec: str, what: str, timeout_s: float | None = None) -> None:
    """Import ``spec``'s module (``"pkg.mod:fn"``) in a supervised child; raise a one-line
    ``ConfigError`` naming ``what`` and the module if it blocks past ``timeout_s`` or ends the
    process. An ordinary import error passes (the in-process import reports it)."""
    module = spec.partition(":")[0].strip()
    if not module:
        return
    timeout_s = import_timeout_s() if timeout_s is None else timeout_s
    ended = _run_child(_CHILD, [module], timeout_s)
    if ended is None:
        raise ConfigError(f"{what} {spec!r}: importing module {module!r} did not finish within {timeout_s:g} s "
                          "(does it block or wait for input at import?)")
    if not ended:
        return  # finished, or an exception at import: import_callable says which, in its usual words
    raise ConfigError(
        f"{what} {spec!r}: importing module {module!r} ended the process ({ended}) "
        "before it finished; a module must not exit or crash at import"
    )


def _specs(value: Any) -> Iterable[str]:
    """Every ``"pkg.mod:fn"`` string in a reward setting (a name, a spec, or weighted components)."""
    if isinstance(value, str):
        if ":" in value and not value.startswith(("task:", "hf:")):
            yield value
    elif isinstance(value, dict):
        for key in ("fn", "reward"):
            if key in value:
                yield from _specs(value[key])
        for key in ("components",):
            if key in value:
                yield from _specs(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _specs(item)


def code_specs(cfg) -> list[tuple[str, str]]:
    """``(spec, what)`` for every reward and custom tool of ``cfg`` that names Python code."""
    found: list[tuple[str, str]] = [(s, "reward") for s in _specs(getattr(cfg, "reward", None))]
    env = getattr(cfg, "env", None)
    if isinstance(env, dict):
        tools = env.get("tools", ())
        for tool in tools if isinstance(tools, (list, tuple)) else [tools]:
            if isinstance(tool, str) and ":" in tool:
                found.append((tool, "custom tool"))
    seen, out = set(), []
    for spec, what in found:
        if spec not in seen:
            seen.add(spec)
            out.append((spec, what))
    return out


def probe_environment(spec: str, args: dict | None, timeout_s: float = DEFAULT_ENV_LOAD_TIMEOUT_S) -> None:
    """Build the verifiers environment ``spec`` (``load_environment(**args)``) in a supervised child;
    a one-line ``ConfigError`` naming it if it does not return within ``timeout_s`` or ends the
    process. A load that raises (or calls ``sys.exit``) passes: the trainer's load says which."""
    if not isinstance(spec, str) or not spec.strip():
        return  # the trainer's load refuses it in one line
    source = str(os.path.abspath(os.path.expanduser(spec))) if spec.endswith(".py") else spec
    what = f"env.verifiers {spec!r}"
    try:
        args_json = json.dumps(dict(args or {}))
    except (TypeError, ValueError):
        return  # not plain data: the trainer's load refuses it in one line
    ended = _run_child(_ENV_CHILD, [source, args_json], timeout_s)
    if ended is None:
        raise ConfigError(f"{what}: load_environment did not return within {timeout_s:g} s (env.load_timeout_s); "
                          "does it block or wait for input? raise env.load_timeout_s for a slow dataset")
    if not ended:
        return  # returned, or an exception outside load_environment's own guard: the trainer's load reports it
    raise ConfigError(f"{what}: load_environment ended the process ({ended}) before it "
                      "returned; an environment must return, not exit or crash")


def check_imports(cfg, timeout_s: float | None = None) -> None:
    """``probe_import`` every reward and custom tool module of ``cfg``; ``probe_environment`` its
    verifiers environment."""
    for spec, what in code_specs(cfg):
        probe_import(spec, what, timeout_s)
    env = getattr(cfg, "env", None)
    if isinstance(env, dict) and env.get("verifiers"):
        probe_environment(env["verifiers"], env.get("args"), float(env.get("load_timeout_s")
                                                                   or DEFAULT_ENV_LOAD_TIMEOUT_S))
