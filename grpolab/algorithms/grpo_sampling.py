"""Sample and score a rollout batch of groups — the first phase of GRPO — with DAPO's dynamic
sampling (Yu et al. 2025, §3.2) and soft overlong punishment (§3.4) as options.

Dynamic sampling draws batches of prompts until ``rollout_batch_size / group_size`` groups whose
verifier rewards vary (before any overlong shaping, as DAPO filters on accuracy) are kept (a
zero-variance group has advantage 0: it spends rollout compute and gives no gradient), or
``max_sampling_rounds`` rounds have been drawn; a batch still short then is filled with
zero-variance groups (they train nothing) and the fill is logged. The figures logged make the
"signal budget" visible: groups drawn, kept and dropped, and the share of sampled tokens spent on
dropped groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..core import overlong_reward_penalty
from ..data.datasets import Example
from ..envs import apply_call_cost
from ..rollout import Rollout
from ..rollout.process import ProcessRolloutBackend
from ..training import distributed
from ..training.run_model import check_probe


@dataclass
class ScoredGroups:
    """A rollout batch's rollouts (prompt-major groups, ``prompt_index`` into ``examples``), their
    scores, their rewards (shaped when asked) and the sampling figures."""

    rollouts: list
    scores: list[dict]
    rewards: torch.Tensor
    examples: list
    samples_drawn: int
    stats: dict[str, float] = field(default_factory=dict)


def _score_round(backend, scorer, examples: list, template, cfg, sampling) -> tuple[list, list[dict], torch.Tensor]:
    """Sample and score one batch of prompts; the rewards include the overlong penalty when asked."""
    rollouts = backend.generate([template.format(e.question) for e in examples], cfg.group_size, sampling)
    scores = scorer.score([r.scored_response for r in rollouts], [examples[r.prompt_index].answer for r in rollouts],
                          prompts=[r.prompt for r in rollouts],
                          questions=[examples[r.prompt_index].question for r in rollouts], rollouts=rollouts)
    scores = apply_call_cost(scores, rollouts, getattr(cfg, "call_cost", 0.0))  # tool use: a price per call
    rewards = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
    if cfg.overlong_buffer_len:
        # a multi-turn response (tool observations included) is bounded by the environment's total
        # budget, not by one turn's sampling_max_tokens: measured against that, a short answer after a
        # long observation would be punished as overlong
        env = getattr(backend, "env", None)
        limit = env.max_total_tokens if env is not None else cfg.sampling_max_tokens
        lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32)
        rewards = rewards + overlong_reward_penalty(
            lengths, limit, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
        )
    return rollouts, scores, rewards


def sample_groups(backend, scorer, sampler, inputs, cfg, sampling) -> ScoredGroups:
    """One rollout batch: ``rollout_batch_size / group_size`` prompts x ``group_size`` responses,
    scored; with ``cfg.dynamic_sampling``, only groups whose rewards vary (see the module doc).

    In a distributed run every rank draws the same prompts (the sampler is seeded alike) and keeps
    its contiguous share: each group stays on one rank and is scored there; ``samples_drawn`` and
    the sampling figures are totals over ranks."""
    n_prompts = cfg.rollout_batch_size // cfg.group_size
    if not cfg.dynamic_sampling:
        examples = distributed.shard([inputs.train[i] for i in sampler.next(n_prompts)])
        rollouts, scores, rewards = _score_round(backend, scorer, examples, inputs.template, cfg, sampling)
        return ScoredGroups(rollouts, scores, rewards, examples, distributed.all_reduce(len(rollouts)))
    kept, dropped = [], []  # (example, rollouts, scores, rewards) per group
    drawn = rounds = 0
    tokens = {"kept": 0, "dropped": 0}
    need = len(distributed.shard(list(range(n_prompts))))  # this rank's groups
    # ranks draw in step (the same sampler positions) until every rank has its groups
    while distributed.all_reduce(int(len(kept) < need), "max") and rounds < cfg.max_sampling_rounds:
        rounds += 1
        examples = distributed.shard([inputs.train[i] for i in sampler.next(n_prompts)])
        rollouts, scores, rewards = _score_round(backend, scorer, examples, inputs.template, cfg, sampling)
        drawn += len(examples)
        for g, example in enumerate(examples):
            sl = slice(g * cfg.group_size, (g + 1) * cfg.group_size)
            group = (example, rollouts[sl], scores[sl], rewards[sl])
            verified = [s["reward"] for s in scores[sl]]  # DAPO filters on the verifier's reward, not the shaped one
            signal = max(verified) > min(verified)
            n_tok = sum(len(r.response_ids) for r in rollouts[sl])
            (kept if signal else dropped).append(group)
            tokens["kept" if signal else "dropped"] += n_tok
    unused = max(0, len(kept) - need)
    filled = max(0, need - len(kept))
    groups = kept[:need] + dropped[:filled]
    total = {
        k: distributed.all_reduce(v)
        for k, v in (("drawn", drawn), ("kept", min(len(kept), need)), ("dropped", len(dropped)), ("unused", unused),
                     ("filled", filled), ("tok_kept", tokens["kept"]), ("tok_dropped", tokens["dropped"]))
    }
    stats = {
        "sampling/rounds": rounds, "sampling/groups_drawn": total["drawn"], "sampling/groups_kept": total["kept"],
        "sampling/groups_dropped": total["dropped"], "sampling/groups_unused": total["unused"],
        "sampling/groups_filled": total["filled"],
        "sampling/dropped_token_share": total["tok_dropped"] / max(1, total["tok_kept"] + total["tok_dropped"]),
    }
    return _assemble(groups, total["drawn"] * cfg.group_size, stats)


def _assemble(groups: list, samples_drawn: int, stats: dict) -> ScoredGroups:
    """Concatenate groups into one prompt-major batch, re-indexing each rollout's prompt."""
    examples, rollouts, scores, rewards = [], [], [], []
    for index, (example, g_rollouts, g_scores, g_rewards) in enumerate(groups):
        examples.append(example)
        rollouts.extend(dataclasses.replace(r, prompt_index=index) for r in g_rollouts)
        scores.extend(g_scores)
        rewards.append(g_rewards)
    return ScoredGroups(rollouts, scores, torch.cat(rewards), examples, samples_drawn, stats)


# ---------------------------------------------------------------- asynchronous rollouts (max_staleness >= 1)


def encode_groups(groups: ScoredGroups) -> dict:
    """A scored batch as plain checkpoint state (lists, dicts, tensors: what ``weights_only`` loads)."""
    return {"rollouts": [dataclasses.asdict(r) for r in groups.rollouts], "scores": groups.scores,
            "rewards": groups.rewards, "examples": [dataclasses.asdict(e) for e in groups.examples],
            "samples_drawn": groups.samples_drawn, "stats": groups.stats}


def decode_groups(state: dict) -> ScoredGroups:
    return ScoredGroups([Rollout(**r) for r in state["rollouts"]], list(state["scores"]), state["rewards"],
                        [Example(**e) for e in state["examples"]], int(state["samples_drawn"]), dict(state["stats"]))


class LockedScorer:
    """A reward scorer shared by the rollout producer's thread and the trainer's (validation): one
    ``score`` at a time; every other attribute is the scorer's."""

    def __init__(self, scorer):
        import threading

        self._scorer, self._lock = scorer, threading.Lock()

    def score(self, *args, **kwargs):
        with self._lock:
            return self._scorer.score(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._scorer, name)


class StagedWeights:
    """``stage``/``load_staged`` for a backend that only has ``sync_weights`` (a vLLM server): staged
    weights are held as a CPU copy until the producer loads them between two batches. With ``probe``
    (the trainer's ``RunModel.probe``) the sync canary runs: the trainer's probe log-probs are taken
    when a version is staged (its weights), and the backend's, after the producer loaded it, must match."""

    def __init__(self, backend, probe=None):
        self.backend, self._weights, self._expected = backend, None, None
        self.probe = probe if hasattr(backend, "probe_log_probs") else None

    def stage(self, weights) -> None:
        self._expected = self.probe() if self.probe is not None else None  # the weights being staged
        self._weights = {name: value.detach().to("cpu", copy=True) for name, value in weights}

    def load_staged(self) -> None:
        weights, self._weights = self._weights, None
        self.backend.sync_weights(getattr(self.backend, "model", None), weights=iter(weights.items()))
        if self._expected is not None:  # the producer's thread: the error names the step (AsyncRollouts)
            (ids, mine), self._expected = self._expected, None
            check_probe(mine, self.backend.probe_log_probs(ids), self.backend.weights_dtype)


def sampler_backend(cfg, model, tokenizer, make, generator, probe=None):
    """The backend an asynchronous run samples with (its own weights), the object that stages and
    loads its weights (``probe``: the trainer's sync-canary probe, for an engine that cannot hand its
    weights back), and ``reseed(b)`` (each batch's draws seeded from the run's seed and b, so a
    resumed run draws what the uninterrupted one drew)."""
    seed_of = lambda b: (cfg.seed * 1_000_003 + b) % 2**63  # noqa: E731
    if cfg.rollout_backend == "hf":
        backend = ProcessRolloutBackend(model, tokenizer, threads=cfg.sampler_threads,
                                        max_batch_size=cfg.rollout_max_batch_size,
                                        autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None,
                                        seed=cfg.seed, check_sync=cfg.check_weight_sync)
        return backend, backend, lambda b: backend.reseed(seed_of(b))
    backend = make()
    stager = StagedWeights(backend, probe if cfg.check_weight_sync else None)
    return backend, stager, lambda b: generator.manual_seed(seed_of(b))
