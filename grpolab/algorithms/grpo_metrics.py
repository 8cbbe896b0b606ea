"""GRPO's step figures, kept out of the loop: the rollout batch's rewards, lengths and health
figures (``rollout_metrics``), the step's timing and counters (``StepClock``), the per-token figures
it records for the viewer (``grpo_per_token``), and the records and health check that end a step
(``log_step``)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ..envs import tool_metrics
from ..training.batching import RolloutBatch
from ..training.distributed import mean_metrics
from ..training.health import HealthMonitor, rollout_health
from ..training.run import ListState, Run


class StepClock:
    """One GRPO step's timing and counter bookkeeping: the seconds of its phases (``time/*``), the
    reward errors it caused, and the running count of responses sampled (``samples``, a checkpointed
    ``ListState``). ``start`` opens a step; ``figures`` adds them to the step's metrics."""

    def __init__(self, scorer, samples: ListState):
        self.scorer, self.samples = scorer, samples

    def start(self) -> None:
        """The step begins: its clock, and the scorer's error count so far."""
        self.t0 = self.update_t0 = time.perf_counter()
        self.errors_before = self.scorer.errors
        self.seconds: dict[str, float] = {}

    def start_update(self) -> None:
        """The training half of the step begins (``time/train_s`` runs from here)."""
        self.update_t0 = time.perf_counter()

    @contextmanager
    def timed(self, name: str):
        """Time the ``with`` block as ``time/<name>``."""
        t = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t

    def figures(self, m: dict, run: Run, groups, is_stats: dict, with_tools: bool,
                reward_errors: int | None = None) -> dict[str, float]:
        """``m`` (the rollout figures) with the step's timing, counters, tool figures and sampling
        figures added, averaged over ranks (every rank then judges the whole batch's health).
        ``reward_errors``: the batch's, where it was scored apart from the step (asynchronous rollouts);
        a ``time/rollout_s`` already in ``m`` (the producer's) is kept."""
        if reward_errors is None:
            reward_errors = self.scorer.errors - self.errors_before
        sync_s = self.seconds.get("weight_sync_s", 0.0)
        m["time/token_records_s"] = self.seconds["token_records_s"]
        if with_tools:  # tool calls, errors, turns, observation vs model tokens
            m.update(tool_metrics(groups.rollouts))
        now = time.perf_counter()
        m.update({**groups.stats, **is_stats, "health/reward_errors": reward_errors,
                  "health/nonfinite_steps": run.nonfinite_steps,
                  "time/rollout_s": m.get("time/rollout_s", self.seconds["rollout_s"]),
                  "time/train_s": now - self.update_t0 - sync_s - m["time/token_records_s"],
                  "time/weight_sync_s": sync_s, "time/log_probs_s": self.seconds["log_probs_s"],
                  "time/elapsed_s": now - run.wall,
                  "time/tokens_per_s": sum(len(r.response_ids) for r in groups.rollouts) / max(now - self.t0, 1e-9)})
        if sync_s and run.weights.engine_holds_weights:  # the most bytes beyond the shard a sync held at once
            m["memory/weight_sync_gathered_mb_max"] = run.weights.gathered_peak_bytes / 2**20
        self.samples.items[0] += groups.samples_drawn
        m["train/samples_drawn"] = self.samples.items[0]
        return mean_metrics(m)


def grpo_per_token(batch, update, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-token figures of a GRPO step: the sampler's log-probs, the trainer's before the
    update (every row where old log-probs were computed, else the rows the update forwarded), and
    the update's entropy, ratio and clip flags."""
    if batch.pre_update_log_probs is not None:
        trainer = batch.pre_update_log_probs
    else:
        trainer = torch.where(update.trained.unsqueeze(1), update.trainer_lp, torch.tensor(float("nan")))
    return {"sampler_lp": batch.sampler_log_probs, "trainer_lp": trainer, **stats}


def rollout_metrics(rollouts, scores, batch: RolloutBatch, update, group_size: int) -> dict[str, float]:
    """The rollout batch's figures: rewards, lengths, and the health figures (``health/*``)."""
    raw = batch.raw_rewards
    lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32)
    correct = raw >= 1.0
    fmt = torch.tensor([s.get("format_reward", 1.0) for s in scores])
    ans = torch.tensor([s.get("answer_reward", s["reward"]) for s in scores])
    # the trainer's log-prob of every sampled token is known where old log-probs were computed (off-policy, IS
    # correction: every row), else on the rows the update forwarded
    every_row = batch.pre_update_log_probs is not None
    measured = torch.ones_like(update.trained) if every_row else update.trained
    health = rollout_health(raw, group_size, [r.finish_reason for r in rollouts], fmt, ans, batch.sampler_log_probs,
                            batch.pre_update_log_probs if every_row else update.trainer_lp,
                            batch.response_mask & measured.unsqueeze(1),
                            answer_checked=all("answer_reward" in s for s in scores))  # not a reward model alone
    m = {
        "train/reward": float(raw.mean()), "train/reward_std": float(raw.std()) if len(raw) > 1 else 0.0,
        "train/format_reward": float(fmt.mean()), "train/answer_reward": float(ans.mean()),
        "train/response_length": float(lengths.mean()),
        "train/response_length_correct": float(lengths[correct].mean()) if correct.any() else 0.0,
        "train/response_length_incorrect": float(lengths[~correct].mean()) if (~correct).any() else 0.0,
        "train/kl_early_stop": int(update.stopped_early), "train/skipped_updates_kl_stop": update.skipped_kl_stop,
        **{f"health/{k}": v for k, v in health.items()},
    }
    for k in scores[0]:
        if k not in ("reward", "format_reward", "answer_reward"):
            m[f"train/reward_{k}"] = sum(s.get(k, 0.0) for s in scores) / len(scores)
    return m


def log_step(run: Run, health: HealthMonitor, update, m: dict, last_reward_error, step: int) -> None:
    """One record per optimizer step (the rollout figures on the first), then the health check. Summed
    over a step's records, ``train/skipped_updates`` counts its updates not taken (non-finite, KL early stop)."""
    for i, record in enumerate(update.records or [{"grpo_step": step}]):
        if i == 0:
            skipped = record.get("train/skipped_updates", 0) + update.skipped_kl_stop
            record = {**record, **m, "train/skipped_updates": skipped}
        run.log(record)
    figures = {k[7:]: v for k, v in m.items() if k.startswith("health/")}
    for message in health.update({**figures, "reward_mean": m["train/reward"], "last_reward_error": last_reward_error,
                                  "tools/errors_per_rollout": m.get("tools/errors_per_rollout")}):
        run.bar.write(f"grpolab health: {message}")
    run.bar.set_postfix(reward=f"{m['train/reward']:.3f}")
