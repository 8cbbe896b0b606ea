"""``evaluate``: generate for held-out questions, grade them through a guarded reward, summarise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..rewards import RewardScorer
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


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _score(scorer: RewardScorer | None, reward_fn, reward_timeout_s: float, responses, gts, prompts=None,
           questions=None):
    """Scores and the number of reward errors of this call (a reused scorer keeps its own total)."""
    own = scorer is None
    scorer = scorer or RewardScorer(reward_fn, timeout_s=reward_timeout_s)
    before = scorer.errors
    try:
        scores = scorer.score(responses, gts, prompts=prompts, questions=questions)
    finally:
        if own:
            scorer.close()
    return scores, scorer.errors - before


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
    """Answer accuracy, format rate, mean response length (all, correct, incorrect), truncation.

    Rewards go through a ``RewardScorer`` (``scorer``, or one made with ``reward_timeout_s``): a
    reward that raises, returns NaN or runs past the timeout scores 0 and is counted in
    ``reward_errors`` instead of ending the evaluation."""
    prompts = [template.format(e.question) for e in examples]
    rollouts = backend.generate(prompts, n, sampling)
    gts = [examples[r.prompt_index].answer for r in rollouts]
    scores, errors = _score(scorer, reward_fn, reward_timeout_s, [r.scored_response for r in rollouts], gts,
                            [r.prompt for r in rollouts], [examples[r.prompt_index].question for r in rollouts])
    lengths = [len(r.response_ids) for r in rollouts]
    correct = [s["reward"] >= 1.0 for s in scores]
    metrics = {
        # a right answer in the right format (the plain reward when a custom one reports no answer)
        "accuracy": _mean(s.get("answer_reward", s["reward"]) * s.get("format_reward", 1.0) for s in scores),
        "reward": _mean(s["reward"] for s in scores),
        "format_rate": _mean(s.get("format_reward", 0.0) for s in scores),
        "mean_length": _mean(lengths),
        "mean_length_correct": _mean(l for l, c in zip(lengths, correct) if c),
        "mean_length_incorrect": _mean(l for l, c in zip(lengths, correct) if not c),
        "truncation_rate": _mean(r.finish_reason == "length" for r in rollouts),
        "n": len(rollouts),
        "reward_errors": errors,
    }
    return EvalResult(metrics, rollouts, scores, gts, sampling)
