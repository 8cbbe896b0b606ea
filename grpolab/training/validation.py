"""Validation during a run: the held-out examples sampled as configured and scored, logged with
sample generations; every method validates through ``validation``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..eval import evaluate, log_generations
from . import distributed
from .run_dir import SAMPLES_DIR

if TYPE_CHECKING:
    from .run import Run


def validation(run: Run, backend, inputs, cfg, scorer=None,
               on_samples: Callable[[list], dict[str, float]] | None = None) -> Callable[[int], dict[str, float]]:
    """``validate(step)``: accuracy on the validation examples (sampled as configured), logged with
    sample generations (CS336 ``log_generations``); {} when there is nothing to validate on.
    ``on_samples(rollouts)``: more figures measured on the same validation samples (distillation's
    held-out KL to its teacher); with it, examples without answers (a prompt-only file) are sampled
    for those figures alone."""
    sampling = cfg.eval_sampling_params()

    def measure(step: int) -> dict[str, float]:
        answered = inputs.reward is not None and all(e.answer is not None for e in inputs.evals)
        if not inputs.evals or not (answered or on_samples):
            return {}
        evals = distributed.shard(inputs.evals)  # each rank evaluates its share; figures weighted by share
        if not answered:
            rollouts = backend.generate([inputs.template.format(e.question) for e in evals], 1, sampling)
            return distributed.mean_metrics(on_samples(rollouts), weight=len(evals))
        reward = getattr(inputs, "eval_reward", None)  # beside a reward model: the task's verifier judges
        result = evaluate(backend, evals, inputs.template, reward or inputs.reward, sampling,
                          scorer=scorer if reward is None else None)
        extra = on_samples(result.rollouts) if on_samples is not None else {}
        if cfg.log_generations_samples and run.is_main:
            extra.update(log_generations(run.path / SAMPLES_DIR / f"eval_step_{step}.jsonl", result, step,
                                         run.weights.sampling_model, run.tokenizer, cfg.log_generations_samples))
        return distributed.mean_metrics({**result.metrics, **extra}, weight=len(evals))

    return lambda step: run.validate(step, lambda: measure(step))
