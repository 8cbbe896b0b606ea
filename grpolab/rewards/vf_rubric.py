"""The reward of a ``verifiers`` environment (``env: {verifiers: NAME}``): its own rubric, run in
grpolab's supervised reward workers like any non-built-in reward.

This module loads and checks the environment and rebuilds a rollout's state; the reward itself is
``vf_reward.VfRubric``, bound to the environment the run's config names (never one the data names).
The ground truth is plain data (``{"env", "args", "row"}``: the environment's spec and arguments,
and the dataset row as a JSON mapping), so a worker loads the environment itself (once, cached)
and rebuilds the state there.
A worker imports verifiers while it starts (a time budget of its own), but loads the environment
when it scores its first response, within that response's timeout: an environment whose
``load_environment`` takes longer than ``reward_timeout_s`` (a dataset to download) needs a longer one.

Only the classic API of verifiers 0.3.x is used (``pip install -e '.[envs]'``): ``load_environment``,
``Environment``, ``Rubric.score_rollout``, ``State`` and its message helpers. A module with no
``load_environment`` that exports a ``verifiers.v1`` taskset (verifiers 0.4's API) loads as a
``vf_v1.V1Taskset`` instead (single-turn, or tools through ``grpolab.envs.vf_v1_tools``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
import uuid
from contextlib import contextmanager, suppress
from copy import deepcopy
from functools import lru_cache
from hashlib import sha256
from pathlib import Path
from typing import Any, Callable

from .supervisor import RewardWorker
from .vf_v1 import V1Taskset, exports_v1_taskset

EXTRA_HINT = "pip install -e '.[envs]' (or: pip install 'verifiers>=0.3.1,<0.3.2')"
GROUND_TRUTH_KEYS = ("env", "args", "row")


def require_verifiers():
    """The ``verifiers`` module with its classic API loaded, or a one-line error naming the extra
    that installs it."""
    try:
        import verifiers
    except ImportError:
        raise ValueError(f"env.verifiers needs the verifiers package, which is not installed: {EXTRA_HINT}") from None
    try:
        has_classic_api = callable(getattr(verifiers, "load_environment", None))
    except ImportError as exc:  # a dependency of its classic API is missing
        raise ValueError(f"verifiers cannot be imported ({type(exc).__name__}: {_first_line(exc)}): "
                         f"{EXTRA_HINT}") from None
    if not has_classic_api:
        raise ValueError(f"verifiers {getattr(verifiers, '__version__', '?')} has no classic load_environment API "
                         f"(grpolab needs 0.3.x): {EXTRA_HINT}")
    return verifiers


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _what(spec: str) -> str:
    return f"verifiers environment {spec!r}"


@contextmanager
def signal_handlers_kept():
    """Restore the SIGINT and SIGTERM handlers on the way out: ``Environment.__post_init__`` installs
    its own (a teardown, then exit), which would replace grpolab's (Ctrl-C or SIGTERM: a checkpoint,
    then exit 130 or 143). Only the main thread may set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)


def vf_source(spec: str) -> str:
    """``spec`` as the ground truth names it: a ``.py`` file by its absolute path (a reward worker may
    start elsewhere), anything else as given."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"env.verifiers: expected an environment name, a module or a .py file, got {spec!r}")
    return str(Path(spec).expanduser().resolve()) if spec.endswith(".py") else spec


def load_vf_environment(spec: str, args: dict | None = None):
    """The environment ``spec`` names, built by its ``load_environment(**args)``, cached per (spec,
    args). ``spec``: a ``.py`` file, a dotted module, or an installed environment's name (as
    ``vf.load_environment`` takes it). Every failure is one ``ValueError`` line naming it."""
    spec = vf_source(spec)  # one cache entry per file, however its path is written
    try:
        key = json.dumps(dict(args or {}), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"env.args of {_what(spec)} must be plain data (JSON): {exc}") from None
    return _load_cached(spec, key)


@lru_cache(maxsize=16)
def _load_cached(spec: str, args_json: str):
    args = json.loads(args_json)
    v1_module = _v1_module(spec)
    if v1_module is not None:  # verifiers' current API (0.4): a taskset, no load_environment (vf_v1.py)
        return V1Taskset(spec, v1_module, args)
    vf = require_verifiers()
    with signal_handlers_kept():
        if spec.endswith(".py"):
            load = _file_loader(spec)
        else:
            _check_importable(vf, spec)
            load = lambda **kw: vf.load_environment(spec, **kw)  # noqa: E731
        try:
            env = load(**args)
        except SystemExit as exc:  # V03: sys.exit in load_environment would end grpolab with its code, silently
            raise ValueError(f"{_what(spec)}: load_environment called sys.exit({exc.code!r}); an environment must "
                             "return, not end the process") from None
        except Exception as exc:  # noqa: BLE001 - the environment's own code: any failure is one line
            cause = exc.__cause__ if not spec.endswith(".py") and exc.__cause__ is not None else exc
            where = "" if threading.current_thread() is threading.main_thread() else (
                " (verifiers environments load in the main thread only: an Environment sets signal handlers)")
            raise ValueError(f"{_what(spec)}: load_environment raised {type(cause).__name__}: "
                             f"{_first_line(cause)}{where}") from None
    check_environment(vf, spec, env)
    return env


def _v1_module(spec: str):
    """The module ``spec`` names when it defines no ``load_environment`` but exports a
    ``verifiers.v1`` taskset (``vf_v1.exports_v1_taskset``), else None (the classic path)."""
    if spec.endswith(".py"):
        module = _file_module(spec)
    elif _find_module_cwd_last(spec):
        try:
            module = importlib.import_module(spec)
        except (Exception, SystemExit):  # noqa: BLE001 - the classic path says it in one line
            return None
    else:
        return None
    return None if callable(getattr(module, "load_environment", None)) or not exports_v1_taskset(module) else module


def _file_loader(spec: str):
    """``load_environment`` of the file ``spec``, imported as a module of its own."""
    path = Path(spec).expanduser()
    load = getattr(_file_module(spec), "load_environment", None)
    if not callable(load):
        raise ValueError(f"{_what(spec)}: {path} defines no load_environment function (nor exports a verifiers.v1 "
                         "Taskset subclass via __all__)")
    return load


def _file_module(spec: str):
    """The file ``spec``, imported as a module of its own (once)."""
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"{_what(spec)} not found: no such file")
    name = f"grpolab_vf_env_{path.stem}_{sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    module = sys.modules.get(name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # before exec: dataclasses and pickle look the module up by name
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a user's file (sys.exit at import too: V03)
            del sys.modules[name]
            raise ValueError(f"{_what(spec)}: importing {path} raised {type(exc).__name__}: "
                             f"{_first_line(exc)}") from None
    return module


def _check_importable(vf, spec: str) -> None:
    """A dotted module, or an installed environment (its module, as verifiers names it), that
    defines ``load_environment``; else one line saying which is missing."""
    from verifiers.utils.env_utils import env_module_name

    module_name = spec if _find_module_cwd_last(spec) else env_module_name(spec)
    if not _find_module_cwd_last(module_name):
        raise ValueError(f"{_what(spec)} not found: no module {module_name!r} (give a .py file, a module, or an "
                         "installed environment's name: prime env install NAME)")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the environment's own code (sys.exit too: V03)
        raise ValueError(f"{_what(spec)}: importing {module_name} raised {type(exc).__name__}: "
                         f"{_first_line(exc)}") from None
    if not callable(getattr(module, "load_environment", None)):
        raise ValueError(f"{_what(spec)}: module {module_name} defines no load_environment function")


def _find_module_cwd_last(name: str) -> bool:
    """``_find_module``, else with the working directory searched last, as the reward workers search
    it (V01: under the ``grpolab`` console script, which puts no working directory on ``sys.path``, an
    environment module there was "not found" while ``python -m grpolab`` imported it)."""
    if _find_module(name):
        return True
    cwd = os.getcwd()
    if any(entry in ("", ".") or os.path.abspath(entry) == cwd for entry in sys.path):
        return False
    sys.path.append(cwd)
    importlib.invalidate_caches()
    if _find_module(name):
        return True
    sys.path.remove(cwd)
    return False


def _find_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that does not exist, an empty or relative name
        return False


def check_environment(vf, spec: str, env: Any) -> None:
    """``env`` is a ``vf.Environment`` whose rubric has reward functions (per response or per group)."""
    if not isinstance(env, vf.Environment):
        raise ValueError(f"{_what(spec)}: load_environment returned {type(env).__name__}, not a verifiers "
                         "Environment")
    if not _has_reward_functions(env.rubric):
        raise ValueError(f"{_what(spec)}: its rubric has no reward functions (verifiers cannot score with it)")


def _has_reward_functions(rubric) -> bool:
    """Every rubric of a group (``RubricGroup``) has at least one function, as ``score_rollout`` asserts."""
    rubrics = getattr(rubric, "rubrics", None)
    if rubrics is not None:
        return all(_has_reward_functions(r) for r in rubrics)
    return bool(rubric.funcs)


def environment_kind(env: Any) -> str:
    """``single_turn`` (``SingleTurnEnv``), ``tool`` (``ToolEnv`` and its subclasses) or ``multi_turn``
    (any other environment); a verifiers.v1 taskset is ``tool`` when its tasks have toolsets, else
    single-turn (``vf_v1``)."""
    if isinstance(env, V1Taskset):
        return env.kind
    vf = require_verifiers()
    if isinstance(env, vf.SingleTurnEnv):
        return "single_turn"
    if isinstance(env, vf.ToolEnv):
        return "tool"
    return "multi_turn"


def tool_functions(env: Any) -> dict[str, Callable]:
    """A ``ToolEnv``'s Python functions by the names the model calls them ({} for other environments)."""
    return dict(getattr(env, "tool_map", None) or {}) if environment_kind(env) == "tool" else {}


def rollout_state(env, row: dict, completion: list[dict]):
    """A ``vf.State`` as ``Environment.init_state`` builds it from ``row`` (no client or model:
    nothing is sampled), completed by ``completion``: one trajectory step per assistant message, so
    ``num_turns`` and the tool-call counts read as after a rollout. What an environment's own
    ``setup_state`` or ``env_response`` would add to the state is not there."""
    from verifiers.types import RolloutTiming, State, TrajectoryStep, flatten_task_input
    from verifiers.utils.message_utils import normalize_messages

    state_input = deepcopy(row)
    if isinstance(state_input.get("info"), str):
        state_input["info"] = json.loads(state_input["info"])
    task = flatten_task_input(state_input)
    state = State(input=task)
    state["task"] = task
    if isinstance(task.get("prompt"), (str, list)):
        state["prompt"] = normalize_messages(task["prompt"], field_name="input.prompt")
    messages = normalize_messages(completion, field_name="completion")
    info = state.get("info")
    tool_defs = info["tool_defs"] if isinstance(info, dict) and "tool_defs" in info else env.tool_defs or []
    trajectory_id = uuid.uuid4().hex
    prompt = list(state.get("prompt") or [])
    steps = [TrajectoryStep(prompt=prompt + messages[:i], completion=[m], response=None, tokens=None, reward=None,
                            advantage=None, is_truncated=False, trajectory_id=trajectory_id, extras={})
             for i, m in enumerate(messages) if m.role == "assistant"]
    state.update(client=None, model=None, sampling_args=None, is_completed=True, is_truncated=False,
                 tool_defs=env._normalize_tool_defs(tool_defs) or [], trajectory=steps, trajectory_id=trajectory_id,
                 reward=None, metrics=None, error=None, final_env_response=None, timing=RolloutTiming())
    state["completion"] = messages
    env._get_usage_tracker(state, create_if_missing=True)  # state["usage"], as init_state leaves it
    return state


def _started_as_reward_worker() -> bool:
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(main_file) and Path(main_file).resolve() == RewardWorker.SCRIPT.resolve()


if _started_as_reward_worker():
    # A reward worker imports this module while starting (a budget of its own): verifiers' classic
    # API (~5 s of imports) is loaded now, so that the first response's timeout does not pay for it.
    with suppress(ValueError):
        require_verifiers()
