"""A verifiers environment's rubric as a reward: ``VfRubric(env, args)``, bound to the environment
the run's config names. The scorer sends that spec to each worker (``worker_spec``; the worker
rebuilds it, never unpickles it), and a ground truth naming any other environment or other
arguments is refused: code is chosen by configuration, never by data (issue 57, V02).

verifiers swallows a reward function's exception (it logs it and scores that function 0); the log
records are collected here per scoring call (``score_counting_errors``), so grpolab counts them as
reward errors (V04). A rubric with group reward functions is scored a GRPO group at a time
(``Rubric.score_group``) when the scorer hands each view with its group (``scoring.group_views``).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
from typing import Any

from .vf_rubric import GROUND_TRUTH_KEYS, _first_line, _what, load_vf_environment, rollout_state, vf_source
from .vf_v1 import V1Taskset

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
        env = load_vf_environment(spec, self.args) if scores is None else None
        if isinstance(env, V1Taskset):  # verifiers 0.4's API: the task's rewards over a trace (and its tools' state)
            info = response.get("info") if isinstance(response, dict) else None
            scores = env.score(row, _completion(response), (info or {}).get("vf_state"))
        elif scores is None:
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
