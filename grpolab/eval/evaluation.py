"""``evaluate``: generate for held-out questions, grade them through a guarded reward, summarise.

With learned reward models (``reward: {model: ...}``) each model's mean raw score is its own figure,
``reward_model/<name>``; ``accuracy``, the format rate, pass@k and maj@k come from a verifier only (a rule
in the reward list that reports ``answer_reward``): an RM's score is not a right answer, and without a
verifier those rows are left out. Evaluation scores unnormalised: it never moves a reward model's
running statistics, and a z-score over the evaluated batch (mean 0 by construction) is no figure.

A verifiers rubric (``env: {verifiers: ...}``) has no accuracy of its own: its ``reward`` is a weighted
sum of functions (reported as ``reward`` and each function's mean, ``vf/<name>``). A response is counted
right when the rubric's answer function (``rubric_roles``: the largest weight) reaches 1, the
rule ``correctness`` applies to a rule reward's ``reward``; ``format_rate`` is the mean of the parser's
format function, left out when the rubric has none."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Sequence

from ..rewards import RewardScorer
from ..rewards.reward_model import unnormalized
from ..rewards.vf_reward import VfRubric
from ..rewards.vf_rubric import load_vf_environment, vf_source
from ..rewards.vf_v1 import V1Taskset
from ..rollout import Rollout, SamplingParams


@dataclass
class EvalResult:
    """What ``evaluate`` saw: the metrics, the rollouts with their scores and ground truths, and
    the sampling settings (``log_generations`` scores entropies at their temperature)."""

    metrics: dict[str, float]
    rollouts: list[Rollout]
    scores: list[dict[str, float]]
    ground_truths: list[Any]
    sampling: SamplingParams | None = None
    correct: list[bool] | None = None  # per rollout, by the verifier; None: no verifier (a reward model alone)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _score(scorer: RewardScorer | None, reward_fn, reward_timeout_s: float, responses, gts, prompts=None,
           questions=None, rollouts=None):
    """Scores, the number of reward errors of this call (a reused scorer keeps its own total), and the
    names of the reward models among the components (none for a rule reward)."""
    own = scorer is None
    scorer = scorer or RewardScorer(reward_fn, timeout_s=reward_timeout_s)
    before = scorer.errors
    try:
        with unnormalized(scorer.model_reward):  # a training scorer's running statistics stay as they are
            scores = scorer.score(responses, gts, prompts=prompts, questions=questions, rollouts=rollouts)
    finally:
        if own:
            scorer.close()
    return scores, scorer.errors - before, list(scorer.model_reward.names) if scorer.model_reward else []


def rubric_roles(spec: str, args: dict | None = None) -> tuple[str | None, str | None]:
    """The rubric's answer function and its parser's format function, by the names its scores carry
    (``vf/NAME``). The answer function is the one of the largest positive weight other than the
    format function (the first on a tie): verifiers' convention weighs the correctness check 1.0 and
    format or style checks less, and has no accuracy of its own. The format function is the one a
    parser's ``get_format_reward_func()`` builds (same qualified name), None when the rubric has none."""
    env = load_vf_environment(vf_source(spec), args or {})
    if isinstance(env, V1Taskset):  # verifiers 0.4's API: the task's rewards, no parser
        return env.roles()
    rubric = env.rubric
    parsers = [getattr(r, "parser", None) for r in [env, rubric, *getattr(rubric, "rubrics", [])]]
    formats = set()
    for parser in parsers:
        with suppress(Exception):  # a parser without a format function of its own
            formats.add(parser.get_format_reward_func().__qualname__)
    funcs = list(zip(rubric._get_reward_funcs(), rubric._get_reward_weights()))
    name = lambda f: getattr(f, "__name__", repr(f))  # noqa: E731 - verifiers' own naming of a function
    fmt = next((name(f) for f, _ in funcs if getattr(f, "__qualname__", None) in formats), None)
    answers = [(w, -i, name(f)) for i, (f, w) in enumerate(funcs) if w > 0 and name(f) != fmt]
    return (max(answers)[2] if answers else None), fmt


def vf_roles(reward: Any) -> tuple[str | None, str | None] | None:
    """A verifiers rubric's (answer, format) function names (``rubric_roles``) when the reward is a
    verifiers environment's rubric (``VfRubric``: the configured environment, never one a ground
    truth names: issue 57 V02), else None."""
    return rubric_roles(reward.env, reward.args) if isinstance(reward, VfRubric) else None


def correctness(scores: list[dict[str, float]], model_names: list[str],
                vf: tuple[str | None, str | None] | None = None) -> list[bool] | None:
    """Whether each response is right: ``reward >= 1`` for a rule reward; for a verifiers rubric (``vf``:
    its answer and format function names), its answer function's value ``>= 1``; beside reward models, the
    verifier's ``answer_reward`` (times its ``format_reward``) — None when no component is a verifier."""
    if vf is not None and vf[0] is not None:
        return [s.get(f"vf/{vf[0]}", s["reward"]) >= 1.0 for s in scores]
    if not model_names:
        return [s["reward"] >= 1.0 for s in scores]
    if not any("answer_reward" in s for s in scores):
        return None
    return [_answer(s) >= 1.0 for s in scores]


def _answer(s: dict[str, float]) -> float:
    """A right answer in the right format (the plain reward when a custom one reports no answer)."""
    return s.get("answer_reward", s["reward"]) * s.get("format_reward", 1.0)


def score_metrics(scores: list[dict[str, float]], lengths: list[int], model_names: list[str],
                  correct: list[bool] | None, vf: tuple[str | None, str | None] | None = None) -> dict[str, float]:
    """accuracy and the format rate (a verifier's: left out beside reward models without one), the mean
    reward, each reward model's mean raw score (``reward_model/<name>``) and the lengths of right and wrong
    answers. For a verifiers rubric (``vf``: see the module doc) accuracy is the share counted right, the
    format rate its parser's format function's mean (left out without one), and each ``vf/<name>`` its mean."""
    verified = correct is not None
    if vf is not None and verified:
        out = {"accuracy": _mean(correct)}
    else:
        out = {"accuracy": _mean(_answer(s) for s in scores)} if verified else {}
    out["reward"] = _mean(s["reward"] for s in scores)
    out.update({f"reward_model/{name}": _mean(s.get(f"{name}_raw", 0.0) for s in scores) for name in model_names})
    if vf is not None:
        names = sorted({k for s in scores for k in s if k.startswith("vf/")})
        out.update({k: _mean(s.get(k, 0.0) for s in scores) for k in names})
        if vf[1] is not None:
            out["format_rate"] = _mean(s.get(f"vf/{vf[1]}", 0.0) for s in scores)
    elif verified:
        out["format_rate"] = _mean(s.get("format_reward", 0.0) for s in scores)
    out["mean_length"] = _mean(lengths)
    if verified:
        out["mean_length_correct"] = _mean(n for n, c in zip(lengths, correct) if c)
        out["mean_length_incorrect"] = _mean(n for n, c in zip(lengths, correct) if not c)
    return out


def evaluate(
    backend,
    examples: Sequence,
    template,
    reward_fn,
    sampling: SamplingParams,
    n: int = 1,
    scorer: RewardScorer | None = None,
    *,
    reward_timeout_s: float = 10.0,
) -> EvalResult:
    """Answer accuracy, format rate, mean response length (all, correct, incorrect), truncation; beside
    reward models, their mean scores (see the module doc).

    Rewards go through a ``RewardScorer`` (``scorer``, or one made with ``reward_timeout_s``): a
    reward that raises, returns NaN or runs past the timeout scores 0 and is counted in
    ``reward_errors`` instead of ending the evaluation."""
    prompts = [template.format(e.question) for e in examples]
    rollouts = backend.generate(prompts, n, sampling)
    gts = [examples[r.prompt_index].answer for r in rollouts]
    scores, errors, model_names = _score(scorer, reward_fn, reward_timeout_s, [r.scored_response for r in rollouts],
                                         gts, [r.prompt for r in rollouts],
                                         [examples[r.prompt_index].question for r in rollouts], rollouts)
    vf = vf_roles(scorer.reward_fn if scorer is not None else reward_fn)
    correct = correctness(scores, model_names, vf)
    metrics = {
        **score_metrics(scores, [len(r.response_ids) for r in rollouts], model_names, correct, vf),
        "truncation_rate": _mean(r.finish_reason == "length" for r in rollouts),
        "n": len(rollouts),
        "reward_errors": errors,
    }
    return EvalResult(metrics, rollouts, scores, gts, sampling, correct)
