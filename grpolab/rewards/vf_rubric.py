"""The reward of a ``verifiers`` environment (``env: {verifiers: NAME}``): its own rubric, run in
grpolab's supervised reward workers like any non-built-in reward.

``VfRubric(env, args)`` is the rubric of the environment the run's config names, bound to it: the
scorer sends that spec to each worker (``worker_spec``; the worker rebuilds it, never unpickles
it), and a ground truth naming any other environment is refused. Code is chosen by configuration,
never by data (issue 57, V02): a data row's answer cannot make a worker import a file. The ground
truth is plain data (``{"env", "args", "row"}``: the environment's spec and arguments, checked
against the bound ones, and the dataset row as a JSON mapping), so a worker loads the environment
itself (once, cached) and rebuilds the state there.
A worker imports verifiers while it starts (a time budget of its own), but loads the environment
when it scores its first response, within that response's timeout: an environment whose
``load_environment`` takes longer than ``reward_timeout_s`` (a dataset to download) needs a longer one.

Only the classic API of verifiers 0.3.x is used (``pip install -e '.[envs]'``): ``load_environment``,
``Environment``, ``Rubric.score_rollout``, ``State`` and its message helpers.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.util
import json
import logging
import math
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
    vf = require_verifiers()
    args = json.loads(args_json)
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


def _file_loader(spec: str):
    """``load_environment`` of the file ``spec``, imported as a module of its own."""
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
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise ValueError(f"{_what(spec)}: {path} defines no load_environment function")
    return load


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


_RUBRIC_ERRORS: contextvars.ContextVar[list | None] = contextvars.ContextVar("grpolab_rubric_errors", default=None)


class _RubricErrors(logging.Handler):
    """verifiers catches a reward function's exception, logs it and scores that function 0 (V04):
    the log records are collected here, per scoring call (a context variable: concurrent rollouts
    each see their own), so grpolab counts them as reward errors."""

    def emit(self, record: logging.LogRecord) -> None:
        sink = _RUBRIC_ERRORS.get()
        if sink is not None and record.levelno >= logging.ERROR:
            sink.append(" ".join(record.getMessage().split()))


_COLLECTOR = _RubricErrors()


def _rubrics(rubric) -> list:
    subs = getattr(rubric, "rubrics", None)
    return [rubric] + [r for sub in subs for r in _rubrics(sub)] if subs else [rubric]


async def score_counting_errors(rubric, state) -> list[str]:
    """``rubric.score_rollout(state)``; returns the errors verifiers logged instead of raising
    (a reward function that raised, or returned what ``float()`` refuses), [] when there were none."""
    return await _counting_errors(rubric, lambda: rubric.score_rollout(state))


async def score_group_counting_errors(rubric, states: list) -> list[str]:
    """``rubric.score_group(states)`` (its group functions see every state of the group, as in
    verifiers' own rollouts); returns the errors verifiers logged, as ``score_counting_errors``."""
    return await _counting_errors(rubric, lambda: rubric.score_group(states))


async def _counting_errors(rubric, score) -> list[str]:
    for r in _rubrics(rubric):
        logger = getattr(r, "logger", None)
        if isinstance(logger, logging.Logger) and _COLLECTOR not in logger.handlers:
            logger.addHandler(_COLLECTOR)
    sink: list[str] = []
    token = _RUBRIC_ERRORS.set(sink)
    try:
        await score()
    finally:
        _RUBRIC_ERRORS.reset(token)
    return sink


def environment_kind(env: Any) -> str:
    """``single_turn`` (``SingleTurnEnv``), ``tool`` (``ToolEnv`` and its subclasses) or ``multi_turn``
    (any other environment)."""
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


def _completion(response: Any) -> list[dict]:
    """The completion's chat messages: the text as one assistant message, a message list as it is,
    or a rollout's view (``{"response", "messages", "info"}``): its messages, else its text."""
    if isinstance(response, dict) and "response" in response:
        return _completion(response.get("messages") or response["response"])
    if isinstance(response, str):
        return [{"role": "assistant", "content": response}]
    if isinstance(response, list) and all(isinstance(m, dict) and "role" in m for m in response):
        return response
    raise ValueError(f"vf_rubric: expected the response text, a list of chat messages or a rollout's view, "
                     f"got {type(response).__name__}")


def _live_score(response: Any) -> dict | None:
    """The score an environment-driven rollout already got from the rubric on its live state
    (``info["vf_score"]``: ``reward`` and the functions' values), or None; a rubric error logged
    while it was scored (``info["vf_score_error"]``) is raised, so the scorer counts it."""
    info = response.get("info") if isinstance(response, dict) else None
    score = info.get("vf_score") if isinstance(info, dict) else None
    if not isinstance(score, dict) or "reward" not in score:
        return None
    if info.get("vf_score_error"):
        raise ValueError(f"the rubric failed: {info['vf_score_error']}")
    return {"reward": score["reward"], **{f"vf/{k}": v for k, v in score.items() if k != "reward"}}


class VfRubric:
    """The rubric of the run's configured environment (``env: {verifiers: env, args: {...}}``), as a
    reward: ``VfRubric(env, args)(response, ground_truth)``. The environment is the one given here,
    from configuration; a ground truth is only the row to score (V02: a ground truth naming another
    environment or other arguments is an error, never a file to load). ``worker_spec`` is what the
    reward worker rebuilds it from (``registry.build_reward``)."""

    reads_rollout = True  # RewardScorer.score(..., rollouts=...) hands it each rollout's view

    def __init__(self, env: str, args: dict | None = None, scores_groups: bool = False):
        """``scores_groups``: the rubric has group reward functions (verifiers' ``has_group_rewards``):
        the scorer then hands each rollout's view with its whole group (``{"group", "member"}``), and
        the group is scored together (``rubric.score_group``), once per worker (cached)."""
        self.env, self.args, self.scores_groups = vf_source(env), dict(args or {}), scores_groups
        self._groups: dict[str, list] = {}
        try:
            self._args_json = json.dumps(self.args, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"env.args of {_what(self.env)} must be plain data (JSON): {exc}") from None
        self.__name__ = self.__qualname__ = "vf_rubric"

    @property
    def worker_spec(self) -> dict:
        return {"vf_rubric": {"env": self.env, "args": self.args}}

    def __repr__(self) -> str:
        return f"VfRubric({self.env!r}, {self.args!r})"

    def _row(self, ground_truth: Any) -> dict:
        if not isinstance(ground_truth, dict) or "row" not in ground_truth:
            raise ValueError(f"vf_rubric: expected the ground truth of a VerifiersTask example (a mapping of "
                             f"{', '.join(GROUND_TRUTH_KEYS)}), got {type(ground_truth).__name__}")
        named = ground_truth.get("env", self.env)
        if named != self.env:
            raise ValueError(f"vf_rubric: the example names the environment {named!r}, not the run's configured "
                             f"{self.env!r} (env.verifiers); data never chooses the code that scores it")
        try:
            same_args = json.dumps(ground_truth.get("args", self.args), sort_keys=True) == self._args_json
        except (TypeError, ValueError):
            same_args = False
        if not same_args:
            raise ValueError(f"vf_rubric: the example's environment arguments differ from the run's env.args of "
                             f"{_what(self.env)}")
        return ground_truth["row"]

    def __call__(self, response: str | list[dict] | dict, ground_truth: dict) -> dict[str, float]:
        """The environment's rubric on ``response``: the model's text, the completion's chat messages
        (multi-turn and tool rollouts), or the scorer's view of a rollout (``reads_rollout``: its
        messages, or the score its environment-driven rollout already got). Returns ``reward`` (the
        rubric's weighted sum) and each function's value as ``vf/NAME``.

        verifiers swallows an exception of a single reward function (it logs it and scores that
        function 0.0); grpolab raises it here as one line (V04), and a NaN or inf value too: the
        scorer counts either as a reward error and scores the response 0."""
        spec, row = self.env, self._row(ground_truth)
        if isinstance(response, dict) and "group" in response:
            scores = self._group_scores(response["group"], row)[response["member"]]
            if isinstance(scores, str):
                raise ValueError(scores)
            return self._checked(scores)
        scores = _live_score(response)
        if scores is None:
            env = load_vf_environment(spec, self.args)
            completion = _completion(response)
            try:
                state = rollout_state(env, row, completion)
            except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
                raise ValueError(f"{_what(spec)}: the row or completion is not verifiers chat messages "
                                 f"({type(exc).__name__}: {_first_line(exc)})") from None
            errors = asyncio.run(score_counting_errors(env.rubric, state))
            if errors:
                raise ValueError(f"{_what(spec)}: the rubric failed: {errors[0]}")
            scores = {"reward": state["reward"], **{f"vf/{k}": v for k, v in (state["metrics"] or {}).items()}}
        return self._checked(scores)

    def _group_scores(self, views: list, row: dict) -> list:
        """The scores (or an error line) of each member of a group, the rubric run once over it: a
        member with a live score keeps it (a failed rollout's 0), the others are scored together."""
        key = json.dumps([views, row], sort_keys=True, default=str)
        if key in self._groups:
            return self._groups[key]
        spec = self.env
        env = load_vf_environment(spec, self.args)
        out: list = [None] * len(views)
        states, members = [], []
        for i, view in enumerate(views):
            try:
                out[i] = _live_score(view)
            except ValueError as exc:
                out[i] = str(exc)
            if out[i] is None:
                try:
                    states.append(rollout_state(env, row, _completion(view)))
                    members.append(i)
                except (TypeError, ValueError) as exc:
                    out[i] = (f"{_what(spec)}: the row or completion is not verifiers chat messages "
                              f"({type(exc).__name__}: {_first_line(exc)})")
        if states:
            errors = asyncio.run(score_group_counting_errors(env.rubric, states))
            for i, state in zip(members, states):
                out[i] = f"{_what(spec)}: the rubric failed: {errors[0]}" if errors else {
                    "reward": state["reward"], **{f"vf/{k}": v for k, v in (state["metrics"] or {}).items()}}
        if len(self._groups) >= 64:
            self._groups.pop(next(iter(self._groups)))
        self._groups[key] = out
        return out

    def _checked(self, scores: dict) -> dict[str, float]:
        spec, out = self.env, {}
        for key, value in scores.items():
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{_what(spec)}: the rubric's {key} is {value!r}, not a number") from None
            if not math.isfinite(value):
                raise ValueError(f"{_what(spec)}: the rubric's {key} is {value} (NaN or inf is an error, not a "
                                 "reward)")
            out[key] = value
        return out


def _started_as_reward_worker() -> bool:
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(main_file) and Path(main_file).resolve() == RewardWorker.SCRIPT.resolve()


if _started_as_reward_worker():
    # A reward worker imports this module while starting (a budget of its own): verifiers' classic
    # API (~5 s of imports) is loaded now, so that the first response's timeout does not pay for it.
    with suppress(ValueError):
        require_verifiers()
