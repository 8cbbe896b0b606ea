"""GRPO: Group Relative Policy Optimization with verified rewards (Shao et al. 2024, DeepSeekMath;
CS336 A5 Algorithm 3).

For each step: sample ``rollout_batch_size / group_size`` questions, draw ``group_size`` answers
each, score them with the verifier, use the group-normalised reward as every token's advantage,
and take ``epochs_per_rollout_batch`` passes of policy-gradient steps over the rollout batch in
optimizer batches of ``train_batch_size`` (each split into ``gradient_accumulation_steps``
micro-batches). No value network. The hyperparameters, with CS336's defaults, are the fields of
``GRPOConfig`` below; the loop is ``train_grpo``, whose phases are the functions above it.

The policy being optimised is softmax(logits / ``sampling_temperature``): every log-prob (current,
old, reference) is of the distribution the sampler drew from.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from ..core import (
    KL_ESTIMATORS,
    KL_LOSS_ESTIMATORS,
    LENGTH_NORMALIZATIONS,
    advantage_estimator_names,
    compute_advantages,
    importance_sampling_weights,
    pad_token_id,
    policy_loss_names,
    whiten,
)
from ..envs import EnvBackend, tool_metrics
from ..rewards import RewardScorer
from ..rollout import make_backend
from ..training import distributed
from ..training.batching import (
    ExampleSampler,
    RolloutBatch,
    batched_log_probs,
    make_rollout_batch,
    optimizer_batches,
)
from ..training.config import EnvOptions, PolicyUpdateConfig
from ..training.distributed import mean_metrics
from ..training.health import PROBLEMS, HealthMonitor, rollout_health
from ..training.inputs import load_inputs
from ..training.metric_logging import plot_grpo_run
from ..training.optimization import effective_warmup, make_optimizer, make_scheduler
from ..training.resources import check_sampled_inputs
from ..training.run import ListState, Run, TrainResult, frozen_copy, validation
from ..training.token_records import TokenRecorder, empty_stats, grpo_per_token
from .grpo_sampling import sample_groups
from .grpo_update import accumulate_policy_gradient


class GRPOConfig(PolicyUpdateConfig):
    command, steps_field, step_key = "grpo", "n_grpo_steps", "grpo_step"
    samples_with_vllm = True
    # --- CS336 Algorithm 3 (defaults from the handout)
    # (rollout_batch_size 256, group_size 8, train_batch_size 256, gradient_accumulation_steps 128,
    # learning_rate 1e-5, cliprange 0.2 and warmup_steps 1000 come from PolicyUpdateConfig)
    n_grpo_steps: int = Field(200, ge=1)
    advantage_eps: float = Field(1e-6, ge=0)
    advantage_estimator: str = "grpo"  # a name in core's advantage-estimator registry (grpo, rloo, reinforce_plus_plus)
    group_baseline: bool = False  # reinforce_plus_plus: subtract the group mean first (REINFORCE++-baseline)
    epochs_per_rollout_batch: int = Field(1, ge=1)  # > 1 is off-policy; train_batch_size < rollout_batch_size too
    loss_type: str = "reinforce_with_baseline"  # a name in core's policy-loss registry
    use_std_normalization: bool = True
    length_normalization: str = "masked_mean"  # masked_mean | masked_normalize (Dr. GRPO) | token_mean (DAPO)
    normalize_constant: float | None = None  # masked_normalize's constant (default sampling_max_tokens)
    cliprange_high: float | None = Field(None, gt=0)  # DAPO clip-higher (e.g. 0.28)
    # KL to the frozen starting policy (seed design; CS336 uses none). As a loss term the estimator's
    # gradient is what matters: k2 = 0.5 (log pi/ref)^2 gives the gradient of KL(pi || ref); k3 (the GRPO
    # paper's) gives the gradient of KL(ref || pi); k1 = log pi/ref has zero expected gradient (it
    # regularises nothing as a loss, so it is refused here; PPO applies k1 as a reward penalty).
    kl_estimator: str = "k3"
    # --- the 2026 family (each a registered core function or a documented trainer option)
    scale_rewards: Literal["group", "batch", "none"] | None = None  # advantage scale; None: use_std_normalization
    dual_clip_c: float | None = Field(None, gt=1)  # PPO dual-clip (Ye et al. 2020) on grpo_clip, e.g. 3.0
    cispo_low: float | None = Field(None, gt=0)  # CISPO's lower clip of the IS weight (None: no lower bound)
    sapo_tau_pos: float = Field(1.0, gt=0)  # SAPO gate temperatures for positive / negative advantages
    sapo_tau_neg: float = Field(1.05, gt=0)
    entropy_coef: float = Field(0.0, ge=0)  # entropy bonus: -entropy_coef * H per token
    dynamic_sampling: bool = False  # DAPO: keep only groups whose rewards vary (algorithms/sampling.py)
    max_sampling_rounds: int = Field(3, ge=1)  # ... drawing at most this many prompt batches per step
    mask_truncated_completions: bool = False  # responses cut at sampling_max_tokens leave the loss
    overlong_buffer_len: int | None = Field(None, ge=1)  # DAPO soft overlong punishment over the last N tokens
    overlong_penalty_factor: float = Field(1.0, ge=0)
    # sampler/trainer correction: TIS caps the ratio pi_trainer/pi_sampler at the cap, MIS drops tokens
    # (or sequences) whose ratio leaves [1/cap, cap]. Default (None): tis for the vllm backend (its
    # kernels give slightly different log-probs), none for hf (the sampler is the trainer's own forward)
    importance_sampling_correction: Literal["none", "tis", "mis"] | None = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    importance_sampling_cap: float = Field(2.0, gt=1)
    max_rollout_samples: int | None = Field(None, ge=1)  # stop once this many responses were sampled (budgets)
    # --- multi-turn tool use (grpolab.envs): keywords of envs.build_env, e.g. {tools: [search], corpus:
    # corpus.jsonl, top_k: 1, max_turns: 2, max_total_tokens: 128, call_cost: 0.0}. The model generates
    # until a tool call closes, the tool's observation is appended (tokenised once) and generation goes
    # on; observation tokens are context only: they leave every loss, normaliser, KL and entropy.
    env: EnvOptions = None
    # --- speed and precision
    micro_batch_token_budget: int | None = Field(None, ge=1)  # dynamic micro-batching by tokens
    skip_zero_advantage: bool = True  # skip rows whose gradient is exactly zero (same update)
    share_prompt_prefix: bool = True  # run each prompt once per micro-batch for its whole group (same gradient)
    # --- runs and health
    run_dir: str = "runs/grpo"
    health_window: int = Field(5, ge=1)
    truncation_threshold: float = Field(0.5, ge=0, le=1)
    # true: a health problem stops the run (UnhealthyRunError); a list (health.PROBLEMS): only those
    stop_on_unhealthy: bool | list[Literal[PROBLEMS]] = False

    @field_validator("loss_type", "advantage_estimator", "length_normalization", "kl_estimator")
    @classmethod
    def _registered(cls, value: str, info) -> str:
        """Names are checked against core's registries, so a new loss or estimator is one function."""
        allowed = {"loss_type": policy_loss_names(), "advantage_estimator": advantage_estimator_names(),
                   "length_normalization": LENGTH_NORMALIZATIONS, "kl_estimator": tuple(KL_ESTIMATORS)}[info.field_name]
        if value not in allowed:
            raise ValueError(f"unknown {info.field_name}; expected one of {', '.join(allowed)}")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.train_batch_size < self.group_size:
            raise ValueError(
                f"train_batch_size ({self.train_batch_size}) must be at least group_size ({self.group_size})"
            )
        if self.kl_coef > 0 and self.kl_estimator not in KL_LOSS_ESTIMATORS:
            raise ValueError(
                f"kl_estimator '{self.kl_estimator}' has zero expected gradient as a loss term, so it would "
                f"regularise nothing; use one of {', '.join(KL_LOSS_ESTIMATORS)}"
            )
        if self.loss_type == "grpo_clip" and not self.off_policy:
            warnings.warn(
                "loss_type 'grpo_clip' on-policy (one epoch, train_batch_size == rollout_batch_size): the ratio is "
                "always 1, so clipping never acts; it equals reinforce_with_baseline", UserWarning, stacklevel=2)
        return self

    @property
    def call_cost(self) -> float:
        """Reward subtracted per tool call (``env.call_cost``; 0 without an environment)."""
        return float((self.env or {}).get("call_cost", 0.0))

    @property
    def is_correction(self) -> str:
        """The sampler/trainer importance-sampling correction in force (see the field's comment)."""
        if self.importance_sampling_correction is not None:
            return self.importance_sampling_correction
        return "tis" if self.rollout_backend == "vllm" else "none"

    def loss_options(self) -> dict:
        """The selected loss's extra keywords (core's registered losses ignore the others)."""
        options = {"sapo_tau_pos": self.sapo_tau_pos, "sapo_tau_neg": self.sapo_tau_neg}
        if self.dual_clip_c is not None:
            options["dual_clip_c"] = self.dual_clip_c
        if self.cispo_low is not None:
            options["cispo_low"] = self.cispo_low
        return options

    @property
    def off_policy(self) -> bool:
        return self.epochs_per_rollout_batch > 1 or self.train_batch_size < self.rollout_batch_size


# ---------------------------------------------------------------- phases


def group_advantages(raw_rewards: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Group-normalised rewards (zero-variance groups get exactly 0), optionally whitened.

    Under torchrun each rank holds a contiguous share of the rollout batch's groups, but batch-wide
    statistics (``scale_rewards: batch``, ``reinforce_plus_plus``, ``whiten_advantages``) are of the
    whole batch: every rank gathers all ranks' rewards (N floats each), computes the advantages of
    the whole batch with the same code as one process, and keeps its own rows — equal to the
    single-process advantages whatever the number of processes."""
    shares = distributed.all_gather_objects(raw_rewards.tolist())
    whole = torch.tensor([r for share in shares for r in share], dtype=raw_rewards.dtype)
    start = sum(len(share) for share in shares[: distributed.current().rank])
    options = {"advantage_eps": cfg.advantage_eps, "use_std_normalization": cfg.use_std_normalization,
               "group_baseline": cfg.group_baseline}
    if cfg.scale_rewards is not None:
        options["scale_rewards"] = cfg.scale_rewards
    advantages = compute_advantages(cfg.advantage_estimator, whole, cfg.group_size, **options)
    if cfg.whiten_advantages and len(advantages) > 1:
        advantages = whiten(advantages, torch.ones_like(advantages, dtype=torch.bool))
    return advantages[start : start + len(raw_rewards)]


def old_and_reference_log_probs(run: Run, batch: RolloutBatch, cfg: GRPOConfig, ref_model) -> dict[str, float]:
    """Old-policy log-probs (off-policy, or for the sampler/trainer IS correction) and the reference
    policy's, once per rollout batch; with the correction, the IS weights and their figures."""
    rows_per_pass = max(1, cfg.train_batch_size // cfg.gradient_accumulation_steps)
    correct = cfg.is_correction != "none"
    if cfg.off_policy or correct:
        batch.old_log_probs = batched_log_probs(run.model, batch, rows_per_pass, run.device, run.autocast,
                                                cfg.policy_temperature)
        batch.pre_update_log_probs = batch.old_log_probs
    if ref_model is not None:
        batch.ref_log_probs = batched_log_probs(ref_model, batch, rows_per_pass, run.device, run.autocast,
                                                cfg.policy_temperature)
    if not correct:
        return {}
    batch.is_weights, stats = importance_sampling_weights(
        batch.old_log_probs, batch.sampler_log_probs, batch.response_mask, mode=cfg.is_correction,
        level=cfg.importance_sampling_level, cap=cfg.importance_sampling_cap)
    if not cfg.off_policy:
        batch.old_log_probs = None  # on-policy: the ratio is computed against the current forward
    return {f"train/{k}": float(v) for k, v in stats.items()}


@dataclass
class Update:
    """What one rollout batch's policy update did: a record per applied optimizer step, whether
    the KL early stop fired, and the trainer's log-probs of the sampled tokens (where known)."""

    records: list[dict]
    stopped_early: bool
    applied_steps: int  # optimizer steps that changed the weights (not stopped, not skipped as non-finite)
    trainer_lp: torch.Tensor
    trained: torch.Tensor
    mean_kl: float | None


def policy_update(run: Run, batch: RolloutBatch, cfg: GRPOConfig, optimizer, scheduler, kl_ctl, has_reference: bool,
                  step: int, token_stats: dict | None = None) -> Update:
    """``epochs_per_rollout_batch`` passes over the rollout batch in optimizer batches (reshuffled
    each epoch when off-policy), with the KL early stop measured before each optimizer step;
    ``token_stats`` (``token_records.empty_stats``) gets the trained tokens' entropy, ratio and clip."""
    n = len(batch.sequences)
    trainer_lp = batch.old_log_probs.clone() if cfg.off_policy else torch.zeros(batch.labels.shape)
    trained = torch.full((n,), cfg.off_policy, dtype=torch.bool)
    signal = batch.raw_rewards if cfg.loss_type == "no_baseline" else batch.advantages
    has_tokens = batch.response_mask.any(1)  # an empty response never reaches the loss (0/0)
    # a row with zero advantage has zero gradient unless a KL or entropy term acts on it
    regularised = (has_reference and kl_ctl.value > 0) or cfg.entropy_coef > 0
    contributes = has_tokens & ((signal != 0) | regularised | (not cfg.skip_zero_advantage))
    shuffle = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    records, kl_values, stopped, applied = [], [], False, 0
    for epoch in range(cfg.epochs_per_rollout_batch):
        for rows in optimizer_batches(
            n, cfg.train_batch_size, cfg.off_policy, shuffle, [s[2] for s in batch.sequences]
        ):
            record_lp = trainer_lp if epoch == 0 and not cfg.off_policy else None
            sums = accumulate_policy_gradient(run.model, batch, rows, cfg, contributes, kl_ctl.value, run.device,
                                              run.autocast, record_lp, token_stats)
            if record_lp is not None:
                trained[rows] = contributes[rows]
            tok = max(sums["tokens"], 1.0)
            approx_kl = sums["approx_kl"] / tok
            if cfg.kl_stop is not None and cfg.off_policy and approx_kl > cfg.kl_stop:
                optimizer.zero_grad(set_to_none=True)  # measured before the step: this update is not applied
                stopped = True
                break
            result = run.optimizer_step(optimizer, scheduler, sums["loss"])
            applied += not result.skipped
            record = run.update_record({
                "train_step": run.train_step, "grpo_step": step, "epoch": epoch,
                "train/loss": sums["loss"], "train/token_entropy": sums["entropy"] / tok,
                "train/clip_fraction": sums["clip"] / tok, "train/approx_kl_old_new": approx_kl,
                "train/kl_coef": kl_ctl.value,
                "train/rows_trained": int(contributes[rows].sum()), "train/tokens_trained": int(sums["tokens"]),
                "train/forward_tokens": int(sums["forward_tokens"]),
            }, result, optimizer)
            if has_reference:
                record["train/kl"] = sums["kl"] / tok
                kl_values.append(sums["kl"] / tok)
            records.append(record)
            run.train_step += 1
        if stopped:
            break
    return Update(
        records, stopped, applied, trainer_lp, trained, sum(kl_values) / len(kl_values) if kl_values else None
    )


def sync_policy(backend, run: Run, update: Update) -> float:
    """Seconds spent giving the backend the updated weights (0 when no optimizer step was applied:
    the KL early stop fired first, or every step was skipped as non-finite)."""
    if not update.applied_steps:
        return 0.0
    t0 = time.perf_counter()
    run.weights.sync(backend)  # vLLM: streamed one gathered parameter at a time
    return time.perf_counter() - t0


def rollout_metrics(rollouts, scores, batch: RolloutBatch, update: Update, group_size: int) -> dict[str, float]:
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
        "train/kl_early_stop": int(update.stopped_early),
        **{f"health/{k}": v for k, v in health.items()},
    }
    for k in scores[0]:
        if k not in ("reward", "format_reward", "answer_reward"):
            m[f"train/reward_{k}"] = sum(s.get(k, 0.0) for s in scores) / len(scores)
    return m


def log_step(run: Run, health: HealthMonitor, update: Update, m: dict, last_reward_error, step: int) -> None:
    """One record per optimizer step (the rollout figures on the first), then the health check."""
    for i, record in enumerate(update.records or [{"grpo_step": step}]):
        run.log({**record, **(m if i == 0 else {})})
    figures = {k[7:]: v for k, v in m.items() if k.startswith("health/")}
    for message in health.update({**figures, "reward_mean": m["train/reward"], "last_reward_error": last_reward_error,
                                  "tools/errors_per_rollout": m.get("tools/errors_per_rollout")}):
        run.bar.write(f"grpolab health: {message}")
    run.bar.set_postfix(reward=f"{m['train/reward']:.3f}")


# ---------------------------------------------------------------- the loop


def train_grpo(
    cfg: GRPOConfig, *, model=None, tokenizer=None, resume: bool = False, overwrite: bool = False
) -> TrainResult:
    """Run GRPO as configured. ``model``/``tokenizer`` override ``cfg.model`` (e.g. after SFT);
    ``resume`` continues from the newest checkpoint in ``cfg.run_dir``."""
    inputs = load_inputs(cfg, tokenizer)
    with Run(cfg, resume=resume, overwrite=overwrite, model=model, tokenizer=tokenizer,
             check_inputs=check_sampled_inputs(inputs, cfg)) as run:
        model, tokenizer = run.model, run.tokenizer
        scorer = RewardScorer(inputs.reward, timeout_s=cfg.reward_timeout_s, num_workers=cfg.reward_workers,
                              device=run.device)
        if scorer.model_reward is not None:  # reward models' running normalisation, for an exact resume
            run.track("reward_normalization", scorer)
        ref_model = run.track("reference_model", frozen_copy(model)) if cfg.kl_coef > 0 else None
        total_opt_steps = (
            cfg.n_grpo_steps * cfg.rollout_batch_size // cfg.train_batch_size * cfg.epochs_per_rollout_batch
        )
        optimizer = run.track("optimizer", make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay))
        scheduler = run.track("scheduler", make_scheduler(
            optimizer, effective_warmup(cfg.warmup_steps, total_opt_steps), total_opt_steps, cfg.lr_schedule))
        kl_ctl = run.track("kl_controller", cfg.kl_controller())
        sampler = run.track("data", ExampleSampler(len(inputs.train), cfg.seed))
        health = run.track(
            "health",
            HealthMonitor(
                cfg.health_window,
                cfg.truncation_threshold,
                stop_on_unhealthy=cfg.stop_on_unhealthy
                if isinstance(cfg.stop_on_unhealthy, bool)
                else tuple(cfg.stop_on_unhealthy),
            ),
        )
        generator = run.track_rng("sampling", torch.Generator().manual_seed(cfg.seed))
        samples = run.track("samples_drawn", ListState([0]))
        backend = make_backend(
            cfg.rollout_backend,
            run.sampling_model,
            tokenizer,
            max_batch_size=cfg.rollout_max_batch_size,
            autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None,
            generator=generator,
            **cfg.backend_options(),
        )
        if cfg.env is not None:  # multi-turn: the environment runs the tools around the same backend
            backend = EnvBackend(backend, run.env)
        pad_id, sampling = pad_token_id(tokenizer), cfg.sampling_params()
        recorder = TokenRecorder(run.path, cfg.token_record_groups, cfg.seed, enabled=run.is_main,
                                 resume_step=run.step if run.resuming else None)
        validate = validation(run, backend, inputs, cfg, scorer)
        before = validate(0) if not run.resuming else None

        for step in run.steps():
            # 1. sample a group of responses per question and score them (DAPO dynamic sampling optional)
            t0 = time.perf_counter()
            errors_before = scorer.errors
            groups = sample_groups(backend, scorer, sampler, inputs, cfg, sampling)
            rollout_s = time.perf_counter() - t0
            # 2. advantages: the group-normalised reward
            batch = make_rollout_batch(groups.rollouts, groups.rewards, group_advantages(groups.rewards, cfg), pad_id)
            if cfg.mask_truncated_completions:  # responses cut at sampling_max_tokens leave the loss
                batch.response_mask[[r.finish_reason == "length" for r in groups.rollouts]] = False
            # 3. old and reference log-probs, once per rollout batch (inference mode); the IS correction
            t1 = time.perf_counter()
            is_stats = old_and_reference_log_probs(run, batch, cfg, ref_model)
            log_probs_s = time.perf_counter() - t1
            # 4. the policy update: epochs of optimizer batches of micro-batches
            stats = empty_stats(batch.labels.shape) if recorder.groups else None  # per-token figures for the viewer
            update = policy_update(run, batch, cfg, optimizer, scheduler, kl_ctl, ref_model is not None, step, stats)
            if update.mean_kl is not None:
                kl_ctl.update(update.mean_kl, cfg.rollout_batch_size)
            # 5. a backend with its own copy of the weights (vLLM) gets the new ones, in place
            sync_s = sync_policy(backend, run, update)
            # 6. metrics and health
            m = rollout_metrics(groups.rollouts, groups.scores, batch, update, cfg.group_size)
            t2 = time.perf_counter()
            recorder.record(step, groups.rollouts, groups.scores, cfg.group_size, tokenizer,
                            grpo_per_token(batch, update, stats) if stats else {}, batch.advantages, groups.examples)
            m["time/token_records_s"] = time.perf_counter() - t2
            if cfg.env is not None:  # tool calls, errors, turns, observation vs model tokens
                m.update(tool_metrics(groups.rollouts))
            m.update({**groups.stats, **is_stats, "health/reward_errors": scorer.errors - errors_before,
                      "health/nonfinite_steps": run.nonfinite_steps, "time/rollout_s": rollout_s,
                      "time/train_s": time.perf_counter() - t1 - sync_s - m["time/token_records_s"],
                      "time/weight_sync_s": sync_s, "time/log_probs_s": log_probs_s,
                      "time/tokens_per_s": sum(
                          len(r.response_ids) for r in groups.rollouts) / max(time.perf_counter() - t0, 1e-9)})
            if sync_s and run.weights.engine_holds_weights:  # the most bytes beyond the shard a sync held at once
                m["memory/weight_sync_gathered_mb_max"] = run.weights.gathered_peak_bytes / 2**20
            samples.items[0] += groups.samples_drawn
            m["train/samples_drawn"] = samples.items[0]
            m = mean_metrics(m)  # every rank sees (and the health check judges) the whole batch's figures
            log_step(run, health, update, m, scorer.last_error, step)
            if cfg.max_rollout_samples and samples.items[0] >= cfg.max_rollout_samples:
                run.total_steps = step + 1  # the sample budget is spent: this is the last step
            run.end_step(step + 1, validate)
            if step + 1 >= run.total_steps:
                break

        after = validate(run.total_steps)
        scorer.close()
        backend.close()
        return run.finish(
            after, before=before, plot=lambda metrics, out: plot_grpo_run(metrics, out, f"GRPO: {run.path.name}")
        )
