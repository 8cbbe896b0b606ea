"""GRPO: Group Relative Policy Optimization with verified rewards (Shao et al. 2024, DeepSeekMath;
CS336 A5 Algorithm 3).

For each step: sample ``rollout_batch_size / group_size`` questions, draw ``group_size`` answers
each, score them with the verifier, use the group-normalised reward as every token's advantage,
and take ``epochs_per_rollout_batch`` passes of policy-gradient steps over the rollout batch in
optimizer batches of ``train_batch_size`` (each split into ``gradient_accumulation_steps``
micro-batches). No value network. The hyperparameters, with CS336's defaults, are the fields of
``GRPOConfig`` below; the loop is ``train_grpo``, whose phases are the functions above it and in
``grpo_sampling.py`` (sampling and scoring groups), ``grpo_update.py`` (old and reference log-probs,
the policy update) and ``grpo_metrics.py`` (the step's figures, timing and counters).

The policy being optimised is softmax(logits / ``sampling_temperature``): every log-prob (current,
old, reference) is of the distribution the sampler drew from.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from ..core import (
    KL_ESTIMATORS,
    KL_LOSS_ESTIMATORS,
    LENGTH_NORMALIZATIONS,
    advantage_estimator_names,
    compute_advantages,
    pad_token_id,
    policy_loss_names,
    whiten,
)
from ..rewards import RewardScorer
from ..training import distributed
from ..training.batching import ExampleSampler, make_rollout_batch
from ..training.health import PROBLEMS, HealthMonitor
from ..training.inputs import load_inputs
from ..training.metric_logging import plot_reward_curves
from ..training.optimization import effective_warmup, make_optimizer, make_scheduler
from ..training.packing import PackingMode
from ..training.resources import check_sampled_inputs
from ..training.run import ListState, Run, TrainResult
from ..training.run_config import EnvOptions
from ..training.run_model import frozen_copy
from ..training.sampled_run_config import PolicyUpdateConfig
from ..training.token_records import TokenRecorder, empty_stats
from ..training.validation import validation
from .grpo_async import rollout_source
from .grpo_metrics import StepClock, grpo_per_token, log_step, rollout_metrics
from .grpo_update import old_and_reference_log_probs, policy_update, trained_signal


class GRPOConfig(PolicyUpdateConfig):
    """GRPO's fields (CS336 Algorithm 3's names and defaults), beside those of ``PolicyUpdateConfig``:
    rollout_batch_size 256, group_size 8, train_batch_size 256, gradient_accumulation_steps 128,
    learning_rate 1e-5, cliprange 0.2, warmup_steps 1000."""

    command, steps_field, step_key = "grpo", "n_grpo_steps", "grpo_step"
    samples_with_vllm = True
    # groups stay on their rank (a group is its advantage's baseline); the length-planned micro-batches
    # may be uneven, as the loss normalisers are the optimizer batch's
    groups_on_one_rank = uneven_micro_batches = True
    # --- GRPO (CS336 Algorithm 3)
    n_grpo_steps: int = Field(200, ge=1)
    """Outer steps (CS336's n_grpo_steps): each samples a rollout batch and updates the policy on it."""
    advantage_eps: float = Field(1e-6, ge=0)
    """Added to the group's reward std before dividing (CS336's advantage_eps)."""
    advantage_estimator: str = "grpo"
    """grpo (group-normalised rewards), rloo (leave-one-out baseline) or reinforce_plus_plus (batch-normalised):
    a name in core's advantage-estimator registry."""
    group_baseline: bool = False
    """reinforce_plus_plus: subtract the group mean first (REINFORCE++-baseline)."""
    epochs_per_rollout_batch: int = Field(1, ge=1)
    """Passes over each rollout batch (CS336's name); > 1 is off-policy, as train_batch_size < rollout_batch_size."""
    loss_type: str = "reinforce_with_baseline"
    """no_baseline | reinforce_with_baseline | grpo_clip | grpo_no_clip (CS336), gspo, cispo, sapo: a name in
    core's policy-loss registry. grpo_clip clips only off-policy (on-policy its ratio is 1)."""
    use_std_normalization: bool = True
    """Divide each group's centred rewards by its std (CS336's use_std_normalization; false: Dr. GRPO)."""
    length_normalization: str = "masked_mean"
    """How token losses become one: masked_mean (per response, CS336), masked_normalize (sum / normalize_constant,
    Dr. GRPO) or token_mean (over the batch's tokens, DAPO)."""
    normalize_constant: float | None = Field(None, gt=0)
    """masked_normalize's divisor in tokens; null: sampling_max_tokens."""
    cliprange_high: float | None = Field(None, gt=0)
    """DAPO's clip-higher: the upper clip 1 + cliprange_high (e.g. 0.28) with 1 - cliprange below; null: cliprange."""
    kl_estimator: str = "k3"
    """The KL term in the loss (with kl_coef > 0): k3 (the GRPO paper's; its gradient is KL(ref || pi)'s) or k2
    (KL(pi || ref)'s gradient); k1 is refused (zero expected gradient as a loss)."""
    # --- Variants: DAPO, Dr. GRPO, dual-clip, CISPO, SAPO, IS corrections
    scale_rewards: Literal["group", "batch", "none"] | None = None
    """The grpo estimator's std: the group's, the whole batch's (TRL's batch), or none (Dr. GRPO); null:
    use_std_normalization decides."""
    dual_clip_c: float | None = Field(None, gt=1)
    """grpo_clip: PPO dual-clip (Ye et al. 2020), a negative-advantage token's loss capped at -c x A, e.g. 3.0."""
    cispo_low: float | None = Field(None, gt=0)
    """cispo: the IS weight's lower clip 1 - cispo_low; null: no lower bound (MiniMax-M1's choice)."""
    sapo_tau_pos: float = Field(1.0, gt=0)
    """sapo: the gate's temperature for positive advantages (the paper's 1.0)."""
    sapo_tau_neg: float = Field(1.05, gt=0)
    """sapo: the gate's temperature for negative advantages (the paper's 1.05: they decay faster)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: -entropy_coef x H per response token in the loss (0: none; the entropy is logged anyway)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: keep only groups whose rewards vary, drawing more prompts until the batch is full
    (grpo_sampling.py)."""
    max_sampling_rounds: int = Field(3, ge=1)
    """dynamic_sampling: the most prompt batches drawn per step; a batch still short is filled with zero-variance
    groups."""
    mask_truncated_completions: bool = False
    """Responses cut at sampling_max_tokens leave the loss (DAPO's overlong filtering)."""
    overlong_buffer_len: int | None = Field(None, ge=1)
    """DAPO's soft overlong punishment: the last N tokens before sampling_max_tokens are penalised, falling
    linearly to -1 (L_cache); null: off."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    """The overlong punishment's scale (DAPO: 1.0)."""
    importance_sampling_correction: Literal["none", "tis", "mis"] | None = None
    """Sampler/trainer correction: tis caps the weight pi_trainer/pi_sampler at the cap, mis drops tokens (or
    sequences) whose ratio leaves [1/cap, cap]. Null: tis with rollout_backend vllm or vllm_server or with
    max_staleness >= 1, none otherwise."""
    importance_sampling_level: Literal["token", "sequence", "sequence_product"] = "token"
    """The correction's unit: each token's ratio; sequence: each response's, the geometric mean of its token ratios
    (GSPO's, veRL's geometric: length-invariant); sequence_product: their product (shrinks with length)."""
    importance_sampling_cap: float = Field(2.0, gt=1)
    """The correction's cap on the ratio (tis: the most weight; mis: the band [1/cap, cap])."""
    importance_sampling_mask_low: float | None = Field(None, gt=0, le=1)
    """IcePop (Ling team 2025): tokens whose ratio pi_trainer/pi_sampler is below this get weight 0, out of the
    gradient, at any level (IcePop: 0.5); null: no lower bound. Turns the correction on (tis) when it is null."""
    importance_sampling_mask_high: float | None = Field(None, ge=1)
    """IcePop: tokens whose ratio pi_trainer/pi_sampler is above this get weight 0 (IcePop: 2.0); null: no upper
    bound. Turns the correction on (tis) when it is null."""
    max_rollout_samples: int | None = Field(None, ge=1)
    """Stop once this many responses were sampled, dynamic-sampling rounds included (equal budgets across
    variants); null: no limit."""
    # --- Asynchronous rollouts (training/async_rollouts.py)
    max_staleness: int = Field(0, ge=0)
    """0: synchronous. k >= 1: a sampler with its own weights (hf: a sampler process; vllm_server) samples batch b
    under the weights of step b - k while the trainer trains; the loss corrects by the sampler's log-probs (tis)."""
    check_weight_sync: bool = True
    """Sync canary: after each weight sync to a sampler with its own weights, check they are the trainer's
    (tensor sums, or a vLLM engine's log-probs of a fixed probe); stop with one line naming the step if not."""
    sampler_threads: int = Field(1, ge=1)
    """max_staleness >= 1 with rollout_backend hf: torch threads of the sampler process (1: one core generates
    while the trainer's `threads` train)."""
    # --- Multi-turn tool use (grpolab.envs)
    env: EnvOptions = None
    """A tool environment (envs.build_env's keys), e.g. {tools: [search], corpus: corpus.jsonl, max_turns: 2}:
    tool calls run between turns; observation tokens are context only, out of every loss, KL and entropy."""
    # --- Speed (none of these changes the gradient)
    micro_batch_token_budget: int | None = Field(None, ge=1)
    """Dynamic micro-batching: rows packed by length so each micro-batch's padded tokens stay within this; null:
    gradient_accumulation_steps micro-batches."""
    skip_zero_advantage: bool = True
    """Skip rows whose gradient is exactly zero (zero advantage, no KL or entropy term): the same update, faster."""
    share_prompt_prefix: bool = True
    """Run each prompt once per micro-batch for its whole group where the model allows (same gradient, fewer
    tokens)."""
    packing: PackingMode = "auto"
    """Padding-free micro-batches where prompts are not shared: rows packed into sequences of the longest row's
    length, per-row positions, no attention across rows (same log-probs). auto: where the model keeps rows apart."""
    # --- Health checks
    run_dir: str = "runs/grpo"
    health_window: int = Field(5, ge=1)
    """Consecutive steps a problem must last before the health check reports it (reward errors and a
    sampler/trainer mismatch: at once)."""
    truncation_threshold: float = Field(0.5, ge=0, le=1)
    """The health check reports truncation above this fraction of responses cut at sampling_max_tokens."""
    stop_on_unhealthy: bool | list[Literal[PROBLEMS]] = False
    """true: a health problem stops the run (UnhealthyRunError); a list of problem names: only those; false: the
    health check only prints."""

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
        if self.max_staleness:
            if self.max_staleness >= max(2, self.n_grpo_steps):  # reliability case A05
                raise ValueError(f"max_staleness {self.max_staleness} is not below n_grpo_steps {self.n_grpo_steps}: "
                                 "every batch would be sampled by the starting weights; use at most "
                                 f"{max(1, self.n_grpo_steps - 1)}")
            if self.rollout_backend == "vllm":
                raise ValueError("max_staleness >= 1 samples in a process of its own while this one trains: use "
                                 "rollout_backend hf (a sampler process) or vllm_server, not the colocated vllm engine")
            if self.distributed != "none":
                raise ValueError(f"max_staleness >= 1 runs in one process; under distributed: {self.distributed} "
                                 "use max_staleness 0")
            if self.importance_sampling_correction == "none":
                raise ValueError("max_staleness >= 1 samples with older weights than it trains: "
                                 "importance_sampling_correction 'none' would weigh every token as if on-policy; "
                                 "use tis or mis (null: tis)")
        if self.is_band is not None and self.importance_sampling_correction == "none":
            raise ValueError("importance_sampling_mask_low/high mask tokens by their sampler/trainer ratio: they need "
                             "importance_sampling_correction tis or mis (null: tis), not 'none'")
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
        own_weights = self.rollout_backend in ("vllm", "vllm_server") or self.max_staleness > 0
        return "tis" if own_weights or self.is_band is not None else "none"

    @property
    def is_band(self) -> tuple[float | None, float | None] | None:
        """IcePop's token band (importance_sampling_mask_low, _high), or None when neither is set."""
        band = (self.importance_sampling_mask_low, self.importance_sampling_mask_high)
        return None if band == (None, None) else band

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


def optimization(run: Run, cfg: GRPOConfig):
    """AdamW and its schedule over the run's optimizer steps (warm-up capped at 10 % of them), tracked
    for checkpoints."""
    total = cfg.n_grpo_steps * cfg.rollout_batch_size // cfg.train_batch_size * cfg.epochs_per_rollout_batch
    optimizer = run.track("optimizer", make_optimizer(run.model, cfg.learning_rate, cfg.betas, cfg.weight_decay))
    scheduler = run.track("scheduler", make_scheduler(optimizer, effective_warmup(cfg.warmup_steps, total), total,
                                                      cfg.lr_schedule))
    return optimizer, scheduler


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
        optimizer, scheduler = optimization(run, cfg)
        kl_ctl = run.track("kl_controller", cfg.kl_controller())
        sampler = run.track("data", ExampleSampler(len(inputs.train), cfg.seed))
        stop_on = cfg.stop_on_unhealthy if isinstance(cfg.stop_on_unhealthy, bool) else tuple(cfg.stop_on_unhealthy)
        health = run.track("health", HealthMonitor(cfg.health_window, cfg.truncation_threshold,
                                                   stop_on_unhealthy=stop_on))
        generator = run.track_rng("sampling", torch.Generator().manual_seed(cfg.seed))
        clock = StepClock(scorer, run.track("samples_drawn", ListState([0])))
        pad_id, sampling = pad_token_id(tokenizer), cfg.sampling_params()
        source, scorer = rollout_source(run, cfg, inputs, scorer, sampler, sampling, generator)
        recorder = TokenRecorder(run.path, cfg.token_record_groups, cfg.seed, enabled=run.is_main,
                                 resume_step=run.step if run.resuming else None)
        validate = validation(run, source.eval_backend, inputs, cfg, scorer)
        before = validate(0) if not run.resuming else None
        source.start(run)

        for step in run.steps():
            clock.start()
            # 1. sample a group of responses per question and score them (DAPO dynamic sampling optional);
            #    asynchronous: take the batch the producer made under the weights of step - max_staleness
            with clock.timed("rollout_s"):
                groups = source.take(step)
            # 2. advantages: the group-normalised reward
            batch = make_rollout_batch(groups.rollouts, groups.rewards, group_advantages(groups.rewards, cfg), pad_id)
            if cfg.mask_truncated_completions:  # responses cut at sampling_max_tokens leave the loss
                batch.response_mask[[r.finish_reason == "length" for r in groups.rollouts]] = False
            # 3. old and reference log-probs, once per rollout batch (inference mode); the IS correction
            clock.start_update()
            with clock.timed("log_probs_s"):
                is_stats = old_and_reference_log_probs(run, batch, cfg, ref_model)
            # 4. the policy update: epochs of optimizer batches of micro-batches
            stats = empty_stats(batch.labels.shape) if recorder.groups else None  # per-token figures for the viewer
            update = policy_update(run, batch, cfg, optimizer, scheduler, kl_ctl, ref_model is not None, step, stats)
            if update.mean_kl is not None:
                kl_ctl.update(update.mean_kl, cfg.rollout_batch_size)
            # 5. a backend with its own copy of the weights (vLLM) gets the new ones, in place; asynchronous:
            #    the new version goes to the sampler's staging slot, loaded before the batch that needs it
            clock.seconds["weight_sync_s"] = source.hand_over(run, step, update, clock)
            # 6. metrics and health
            m = rollout_metrics(groups.rollouts, groups.scores, batch, update, cfg.group_size)
            with clock.timed("token_records_s"):
                recorder.record(step, groups.rollouts, groups.scores, cfg.group_size, tokenizer,
                                grpo_per_token(batch, update, stats) if stats else {}, trained_signal(batch, cfg),
                                groups.examples)
            m.update(source.figures(step, m, clock))
            m = clock.figures(m, run, groups, is_stats, with_tools=run.env is not None,
                              reward_errors=source.reward_errors)
            log_step(run, health, update, m, scorer.last_error, step)
            if cfg.max_rollout_samples and clock.samples.items[0] >= cfg.max_rollout_samples:
                run.total_steps = step + 1  # the sample budget is spent: this is the last step
                source.limit(run.total_steps)
            run.end_step(step + 1, validate)
            if step + 1 >= run.total_steps:
                break

        source.close()
        after = validate(run.total_steps)
        scorer.close()
        source.backend.close()
        return run.finish(
            after, before=before,
            plot=lambda metrics, out: plot_reward_curves(metrics, out, f"GRPO: {run.path.name}", cfg.step_key)
        )
