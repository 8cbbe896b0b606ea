"""Rewards of the reasoning-gym tasks (``task: rg:NAME``): the dataset's own ``score_answer``.

The ground truth of a reasoning-gym item is ``{"dataset", "options", "entry"}`` (the generator's
name, its config and the item as generated), so a reward worker rebuilds the dataset's scorer by
importing it, never by unpickling it. The functions are module-level on purpose: ``RewardScorer``
runs them in its supervised worker processes (they are not built-ins), under the same timeouts,
memory cap and crash handling as any reward.

What counts as correct: the answer the model states (the last ``<answer>`` block under an
R1-style template; the whole response under a chat template that asks for no tags) is stripped
and given to ``score_answer``; only full credit (1.0) is a correct answer. Partial credit (some
generators give 0.01 to any wrong number, or a fraction for a near string) is reported as
``rg_score`` but not rewarded, and an answer with a hedge word the gold answer lacks ("maybe 20
or 2") scores 0 whatever ``score_answer`` says.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from .normalize import hedge_words
from .verifiers import extract_r1_zero_answer, reward_dict, stated_answer

EXTRA_HINT = "pip install -e '.[gym]' (or: pip install reasoning-gym==0.1.25)"


def require_reasoning_gym():
    """The ``reasoning_gym`` module, or a one-line error naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"rg: tasks need reasoning-gym, which is not installed: {EXTRA_HINT}") from None
    return reasoning_gym


def rg_dataset_names() -> list[str]:
    """The names reasoning-gym registers (``rg:NAME``)."""
    return sorted(require_reasoning_gym().factory.DATASETS)


def make_rg_dataset(name: str, options: dict):
    """``reasoning_gym.create_dataset(name, **options)``; one-line errors naming the available
    datasets (unknown name) or the generator's config fields (unknown or bad option)."""
    rg = require_reasoning_gym()
    if name not in rg.factory.DATASETS:
        raise ValueError(f"unknown reasoning-gym dataset {name!r} (task: rg:{name}); available: "
                         f"{', '.join(rg_dataset_names())}")
    try:
        return rg.create_dataset(name, **options)
    except (TypeError, ValueError, AssertionError) as exc:
        _, config_cls = rg.factory.DATASETS[name]
        fields = ", ".join(getattr(config_cls, "__dataclass_fields__", {}))
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"task_options of rg:{name}: {first}; the generator's fields are: {fields}") from None


@lru_cache(maxsize=16)
def _scorer(name: str, options_json: str):
    return make_rg_dataset(name, json.loads(options_json))


def rg_score(answer: str | None, ground_truth: dict) -> float:
    """``score_answer`` of the item's own dataset (0 for no answer)."""
    if answer is None:
        return 0.0
    dataset = _scorer(ground_truth["dataset"], json.dumps(ground_truth.get("options", {}), sort_keys=True))
    return float(dataset.score_answer(answer, ground_truth["entry"]) or 0.0)


def _graded(answer: str | None, ground_truth: dict, format_ok: bool) -> dict[str, float]:
    if answer is None:
        return {**reward_dict(False, False), "rg_score": 0.0}
    answer = answer.strip()
    score = rg_score(answer, ground_truth)
    hedged = bool(hedge_words(answer) - hedge_words(str(ground_truth["entry"].get("answer", ""))))
    return {**reward_dict(format_ok, score >= 1.0 and not hedged), "rg_score": score}


def rg_reward_fn(response: str, ground_truth: Any, *, lenient_format: bool = False) -> dict[str, float]:
    """R1 format (``</think> <answer>...</answer>``), and the answer block gets full credit."""
    return _graded(extract_r1_zero_answer(response, lenient_format), ground_truth, True)


def rg_reward_fn_lenient(response: str, ground_truth: Any) -> dict[str, float]:
    """``rg_reward_fn`` with any whitespace between ``</think>`` and ``<answer>`` (chat_r1)."""
    return rg_reward_fn(response, ground_truth, lenient_format=True)


def rg_whole_response_reward_fn(response: str, ground_truth: Any) -> dict[str, float]:
    """Under a chat template that asks for no tags: the whole response is the answer."""
    return _graded(response, ground_truth, True)


def rg_stated_answer_reward_fn(response: str, ground_truth: Any) -> dict[str, float]:
    """A chat reply in prose ("The answer is 12."): its ``stated_answer`` (as ``question_only``: the last
    ``\\boxed{}``, else the last number), else the whole response, given to the dataset's ``score_answer``.
    For numeric generators (``chain_sum``, ``basic_arithmetic``) under a chat template:
    ``reward: grpolab.rewards.gym:rg_stated_answer_reward_fn``."""
    answer = stated_answer(response)
    return _graded(response if answer is None else answer, ground_truth, True)


rg_reward_fn.lenient = rg_reward_fn_lenient  # what registry.lenient_reward hands out under chat_r1
