"""GRPO's asynchronous phases (``max_staleness >= 1``; the machinery is ``training/async_rollouts.py``):
the producer's step (``produce``), the data position a checkpoint records (``ConsumedData``),
validation on the trainer's weights (``CurrentPolicy``), the hand-off of each new version
(``publish``) and the step's staleness figures (``async_figures``)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from ..envs import EnvBackend
from ..rollout import make_backend
from ..training.async_rollouts import AsyncRollouts
from ..training.batching import ExampleSampler
from ..training.run import Run
from ..training.run_setup import run_backend
from .grpo_metrics import StepClock
from .grpo_sampling import (
    LockedScorer,
    ScoredGroups,
    decode_groups,
    encode_groups,
    sample_groups,
    sampler_backend,
)

if TYPE_CHECKING:
    from .grpo import GRPOConfig


def produce(backend, scorer, sampler, inputs, cfg: GRPOConfig, sampling) -> ScoredGroups:
    """One rollout batch in the producer's thread: sampled and scored as ``sample_groups``, with the
    seconds it took and the reward errors it caused (the step that trains on it reports them)."""
    t0, errors = time.perf_counter(), scorer.errors
    groups = sample_groups(backend, scorer, sampler, inputs, cfg, sampling)
    groups.stats["time/generate_s"] = time.perf_counter() - t0
    groups.stats["_reward_errors"] = scorer.errors - errors
    return groups


class ConsumedData:
    """The data position a checkpoint records as the run's: after the last batch trained on (the
    producer's sampler is ahead of it; its in-flight batches are the async state's)."""

    def __init__(self, sampler: ExampleSampler, rollouts: AsyncRollouts):
        self.sampler, self.rollouts = sampler, rollouts

    def state_dict(self) -> dict:
        return self.rollouts.consumed_data or self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        pass  # restored into the sampler when it was tracked itself


class CurrentPolicy:
    """Validation in an asynchronous run: the trainer's own weights (the sampler's are older), with
    the plain copy refreshed first where the run keeps one (LoRA)."""

    def __init__(self, run: Run, backend):
        self.run, self.backend = run, backend

    def generate(self, *args, **kwargs):
        self.run.weights.refresh()
        return self.backend.generate(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


class OneAtATime:
    """A backend whose ``generate`` holds a lock shared with others (``pair``): the producer's thread
    and validation (the trainer's) both run the run's environment, whose tool workers and verifiers
    loop serve one caller at a time. Validation then waits for the batch in progress, and the
    producer for validation."""

    def __init__(self, backend, lock):
        self.backend, self._lock = backend, lock

    @classmethod
    def pair(cls, *backends) -> list:
        lock = threading.Lock()
        return [cls(b, lock) for b in backends]

    def generate(self, *args, **kwargs):
        with self._lock:
            return self.backend.generate(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


def publish(rollouts: AsyncRollouts, run: Run, version: int, clock: StepClock) -> float:
    """Hand the weights after this step (``version``) to the sampler's staging slot; the seconds
    waited for the slot go to ``time/trainer_wait_s``, the staging itself is the weight sync."""
    t0 = time.perf_counter()
    clock.seconds["publish_wait_s"] = rollouts.publish(version, run.weights.full_weights())
    return time.perf_counter() - t0 - clock.seconds["publish_wait_s"]


def async_figures(produced, step: int, m: dict, clock: StepClock) -> dict[str, float]:
    """The step's staleness (every response of a batch has one version), the waits, and where the
    batch is stale the sampler/trainer log-prob gap as the policy's lag, not as a mismatch: a stale
    batch measures how far the weights moved, which the health check must not report as a fault."""
    groups = produced.item
    staleness = [step - r.info.setdefault("policy_version", produced.version) for r in groups.rollouts]
    out = {"async/staleness_mean": sum(staleness) / len(staleness), "async/staleness_max": max(staleness),
           "async/policy_version": produced.version,
           "time/trainer_wait_s": produced.extra["trainer_wait_s"] + clock.seconds.get("publish_wait_s", 0.0),
           "time/sampler_wait_s": produced.sampler_wait_s,
           "time/generate_s": groups.stats.pop("time/generate_s", 0.0)}
    produced.extra["reward_errors"] = int(groups.stats.pop("_reward_errors", 0))
    if max(staleness) > 0:
        for key in [k for k in m if k.startswith("health/logprob_mismatch")]:
            value = m.pop(key)
            if key == "health/logprob_mismatch":
                out["async/behaviour_logprob_gap"] = value
    m["time/rollout_s"] = out["time/generate_s"]
    return out


# ---------------------------------------------------------------- where a step's batch comes from


class Synchronous:
    """Today's loop: each step samples with the current weights (``sample_groups``), and a backend
    with its own copy (vLLM) gets the new weights after the update."""

    def __init__(self, backend, scorer, sampler, inputs, cfg, sampling):
        self.backend = self.eval_backend = backend
        self._sample = lambda: sample_groups(backend, scorer, sampler, inputs, cfg, sampling)
        self.reward_errors = None  # the step's own (counted by its clock)

    def start(self, run: Run) -> None:
        pass

    def take(self, step: int) -> ScoredGroups:
        return self._sample()

    def hand_over(self, run: Run, step: int, update, clock: StepClock) -> float:
        """Seconds spent giving the backend the updated weights (0 when no optimizer step was applied:
        the KL early stop fired first, or every step was skipped as non-finite)."""
        if not update.applied_steps:
            return 0.0
        t0 = time.perf_counter()
        run.weights.sync(self.backend, step)  # vLLM: streamed one gathered parameter at a time
        return time.perf_counter() - t0

    def figures(self, step: int, m: dict, clock: StepClock) -> dict:
        return {}

    def limit(self, total: int) -> None:
        pass

    def close(self) -> None:
        pass


class Asynchronous(Synchronous):
    """``max_staleness >= 1``: the batch the producer made under the weights of ``step - k``; the new
    weights go to the sampler's staging slot (``training/async_rollouts.py``)."""

    def __init__(self, run: Run, backend, stager, reseed, scorer, sampler, inputs, cfg, sampling, eval_backend):
        self.backend, self.eval_backend = backend, CurrentPolicy(run, eval_backend)
        self.rollouts = run.track("async_rollouts", AsyncRollouts(
            stager, cfg.max_staleness, lambda b: produce(backend, scorer, sampler, inputs, cfg, sampling),
            sampler, encode_groups, decode_groups, reseed))
        run.track("data", ConsumedData(sampler, self.rollouts))  # checkpoints: the position after the consumed batch
        run.on_close(self.rollouts.close)  # however the run ends: the producer stops, the sampler process goes
        run.on_close(backend.close)

    def start(self, run: Run) -> None:
        self.rollouts.start(run.step, run.total_steps)

    def take(self, step: int) -> ScoredGroups:
        self.produced = self.rollouts.get(step)
        return self.produced.item

    def hand_over(self, run: Run, step: int, update, clock: StepClock) -> float:
        return publish(self.rollouts, run, step + 1, clock)

    def figures(self, step: int, m: dict, clock: StepClock) -> dict:
        out = async_figures(self.produced, step, m, clock)
        self.reward_errors = self.produced.extra["reward_errors"]
        return out

    def limit(self, total: int) -> None:
        self.rollouts.limit(total)

    def close(self) -> None:
        self.rollouts.close()


def rollout_source(run: Run, cfg: GRPOConfig, inputs, scorer, sampler, sampling, generator):
    """(where each step's batch comes from, the scorer to use): ``Synchronous`` on the configured
    backend, or with ``max_staleness >= 1`` ``Asynchronous`` on a sampler with its own weights (its
    scorer then shared with validation behind a lock)."""
    tokenizer = run.tokenizer
    make = lambda: run_backend(run, generator)  # noqa: E731
    with_env = (lambda b: EnvBackend(b, run.env, template=inputs.template)) if run.env is not None \
        else (lambda b: b)  # multi-turn
    if cfg.max_staleness:  # a sampler with its own weights runs ahead (training/async_rollouts.py)
        scorer = LockedScorer(scorer)
        # the sync canary on a vLLM server: the trainer's probe log-probs staged with each version's weights
        own, stager, reseed = sampler_backend(cfg, run.sampling_model, tokenizer, make, generator, run.weights.probe)
        # validation as the synchronous loop's (C5-4): the environment and the run's autocast, on the trainer's
        # weights; the producer's thread and validation share the environment, one generate at a time
        current = make_backend("hf", run.sampling_model, tokenizer, max_batch_size=cfg.rollout_max_batch_size,
                               autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None)
        if run.env is not None:
            own, current = OneAtATime.pair(with_env(own), with_env(current))
        source = Asynchronous(run, own, stager, reseed, scorer, sampler, inputs, cfg, sampling, current)
    else:
        source = Synchronous(with_env(make()), scorer, sampler, inputs, cfg, sampling)
        if cfg.rollout_backend == "vllm_server":  # however the run ends, the server it started stops
            run.on_close(source.backend.close)
    return source, scorer
