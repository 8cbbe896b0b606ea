"""GRPO: Group Relative Policy Optimization with verified rewards (Shao et al. 2024, DeepSeekMath;
CS336 A5 Algorithm 3).

For each step: sample ``rollout_batch_size / group_size`` questions, draw ``group_size`` answers
each, score them with the verifier, use the group-normalised reward as every token's advantage,
and take ``epochs_per_rollout_batch`` passes of policy-gradient steps over the rollout batch in
optimizer batches of ``train_batch_size`` (each split into ``gradient_accumulation_steps``
micro-batches). No value network. The hyperparameters, with CS336's defaults, are the fields of
``GRPOConfig`` below; the loop is ``train_grpo``.
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Literal

import torch
from pydantic import Field, model_validator

from ..core import (
    AdaptiveKLController,
    FixedKLController,
    build_sequences,
    get_response_log_probs,
    grpo_microbatch_train_step,
    kl_k3,
    masked_mean,
    normalize_group_rewards,
    pad_token_id,
    whiten,
)
from ..eval import evaluate, log_generations
from ..models import save_model_and_tokenizer
from ..models.shared_prefix import (
    label_to_response_layout,
    shared_prefix_response_log_probs,
    supports_shared_prefix,
)
from ..rewards import RewardScorer
from ..rollout import make_backend
from .config import SampledRunConfig
from .health import HealthMonitor
from .toolkit import (
    CheckpointManager,
    ExampleSampler,
    MetricsLogger,
    TrainResult,
    autocast_for,
    effective_warmup,
    load_inputs,
    make_optimizer,
    make_scheduler,
    optimizer_step,
    plan_microbatches,
    plot_grpo_run,
    progress,
    restore_rng,
    rng_state,
    start_run,
    take_rows,
)


class GRPOConfig(SampledRunConfig):
    # --- CS336 Algorithm 3 (defaults from the handout)
    n_grpo_steps: int = Field(200, ge=1)
    learning_rate: float = Field(1e-5, gt=0)
    advantage_eps: float = Field(1e-6, ge=0)
    rollout_batch_size: int = Field(256, ge=1)
    group_size: int = Field(8, ge=1)
    epochs_per_rollout_batch: int = Field(1, ge=1)  # > 1 is off-policy
    train_batch_size: int = Field(256, ge=1)  # > rollout_batch_size is an error; < is off-policy
    gradient_accumulation_steps: int = Field(128, ge=1)  # micro-batch = train_batch_size / this
    loss_type: Literal["no_baseline", "reinforce_with_baseline", "grpo_clip", "grpo_no_clip"] = "reinforce_with_baseline"
    use_std_normalization: bool = True
    length_normalization: Literal["masked_mean", "masked_normalize", "token_mean"] = "masked_mean"
    normalize_constant: float | None = None  # masked_normalize's constant (default sampling_max_tokens)
    cliprange: float = Field(0.2, gt=0)
    cliprange_high: float | None = Field(None, gt=0)  # DAPO clip-higher (e.g. 0.28)
    # --- optimizer (AdamW as in CS336) and schedule
    warmup_steps: int = Field(1000, ge=0)  # linear warm-up (seed design), capped at 10 % of the optimizer steps
    lr_schedule: Literal["constant", "cosine"] = "constant"
    whiten_advantages: bool = False  # whiten advantages over the rollout batch after group normalisation
    # --- KL to a frozen reference (seed design; CS336 uses none: kl_coef 0 loads no reference model)
    kl_coef: float = Field(0.0, ge=0)  # the seed design's setting: 0.2 with kl_adaptive
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_adaptive: bool = False
    kl_target: float = Field(0.1, gt=0)  # KL the adaptive controller aims at (nats per token)
    kl_horizon: int = Field(10000, ge=1)
    kl_coef_min: float = Field(0.1, ge=0)
    kl_coef_max: float = Field(0.3, ge=0)
    kl_stop: float | None = Field(0.3, gt=0)  # stop a rollout batch's updates when approx KL(old||new) exceeds it
    # --- speed and precision
    micro_batch_token_budget: int | None = Field(None, ge=1)  # dynamic micro-batching by tokens
    skip_zero_advantage: bool = True  # skip rows whose gradient is exactly zero (same update)
    share_prompt_prefix: bool = True  # run each prompt once per micro-batch for its whole group (same gradient)
    rollout_backend: Literal["hf"] = "hf"
    rollout_max_batch_size: int = Field(256, ge=1)
    reward_timeout_s: float = Field(10.0, ge=0)
    reward_workers: int = Field(0, ge=0)
    # --- evaluation, logging, checkpoints
    eval_every: int = Field(0, ge=0)  # GRPO steps between validation runs (0: only at the end)
    log_generations_samples: int = Field(8, ge=0)
    checkpoint_every: int = Field(0, ge=0)  # GRPO steps between checkpoints (0: only the final model)
    keep_last: int = Field(2, ge=1)
    run_dir: str = "runs/grpo"
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    health_window: int = Field(5, ge=1)
    truncation_threshold: float = Field(0.5, ge=0, le=1)
    stop_on_unhealthy: bool = False
    deterministic: bool = False

    @model_validator(mode="after")
    def _check(self):
        if self.rollout_batch_size % self.group_size:
            raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must be divisible by group_size ({self.group_size})")
        if self.train_batch_size < self.group_size:
            raise ValueError(f"train_batch_size ({self.train_batch_size}) must be at least group_size ({self.group_size})")
        if self.rollout_batch_size % self.train_batch_size:
            raise ValueError(
                f"rollout_batch_size ({self.rollout_batch_size}) must be divisible by train_batch_size ({self.train_batch_size})")
        if self.kl_coef_min > self.kl_coef_max:
            raise ValueError(f"kl_coef_min ({self.kl_coef_min}) exceeds kl_coef_max ({self.kl_coef_max})")
        if self.loss_type == "grpo_clip" and not self.off_policy:
            warnings.warn(
                "loss_type 'grpo_clip' on-policy (one epoch, train_batch_size == rollout_batch_size): the ratio is "
                "always 1, so clipping never acts; it equals reinforce_with_baseline", UserWarning, stacklevel=2)
        return self

    @property
    def off_policy(self) -> bool:
        return self.epochs_per_rollout_batch > 1 or self.train_batch_size < self.rollout_batch_size


# ---------------------------------------------------------------- inputs


def sampler_logprob_tensor(rollouts, shape) -> torch.Tensor:
    """The sampler's log-probs laid out like the trainer's (B, T) label positions."""
    out = torch.zeros(shape)
    for i, r in enumerate(rollouts):
        start = len(r.prompt_ids) - 1
        out[i, start : start + len(r.logprobs)] = torch.tensor(r.logprobs)
    return out


@torch.inference_mode()
def batched_log_probs(model, batch, rows_per_pass: int, device, autocast) -> torch.Tensor:
    """Log-probs of every row of a rollout batch without gradients (old policy, reference)."""
    out = torch.zeros(batch["labels"].shape)
    n = batch["labels"].shape[0]
    for start in range(0, n, rows_per_pass):
        rows = list(range(start, min(n, start + rows_per_pass)))
        mb = take_rows(batch, rows, device)
        with autocast():
            lp = get_response_log_probs(model, mb["input_ids"], mb["labels"])["log_probs"]
        out[rows, : lp.shape[1]] = lp.float().cpu()
    return out


def accumulate_policy_gradient(
    model, batch: dict, rows: list[int], cfg: GRPOConfig, contributes: torch.Tensor, kl_coef: float,
    device, autocast, normalize_constant: float, record_lp: tuple | None = None,
    sequences: list[tuple[list[int], list[int], int]] | None = None,
) -> dict[str, float]:
    """Forward/backward one optimizer batch (``rows`` of the rollout batch) in micro-batches,
    leaving its gradient in ``.grad``. Returns summed figures for logging.

    Rows that cannot contribute (zero advantage and no KL term; empty responses) are skipped, and
    losses are scaled by the whole batch's sequence (or token) count, so the gradient equals the
    fixed-micro-batch gradient whether or not rows are skipped and however rows are packed
    (``micro_batch_token_budget``). With ``sequences`` (each row's prompt ids, response ids and
    prompt index) and ``share_prompt_prefix``, each distinct prompt in a micro-batch is run once
    and shared by its responses (``models.shared_prefix``): the same gradient, fewer tokens.
    """
    mask_all = batch["response_mask"][rows]
    global_tokens = mask_all.sum().clamp(min=1)
    lengths = [int(m.nonzero().max()) + 1 if m.any() else 1 for m in mask_all]
    plans = plan_microbatches(lengths, cfg.gradient_accumulation_steps, cfg.micro_batch_token_budget)
    sums = {"loss": 0.0, "entropy": 0.0, "clip": 0.0, "approx_kl": 0.0, "kl": 0.0, "tokens": 0.0}
    shared = sequences is not None and cfg.share_prompt_prefix and supports_shared_prefix(model)
    for plan in plans:
        live = [rows[i] for i in plan if contributes[rows[i]]]
        if not live:
            continue
        if shared:
            mb, log_probs, entropy = _shared_prefix_microbatch(model, batch, live, sequences, device, autocast)
        else:
            mb = take_rows(batch, live, device)
            with autocast():
                out = get_response_log_probs(model, mb["input_ids"], mb["labels"], return_token_entropy=True)
            log_probs, entropy = out["log_probs"].float(), out["token_entropy"]
        if record_lp is not None:
            trainer_lp, trained = record_lp
            if shared:
                for j, r in enumerate(live):
                    start, n = len(sequences[r][0]) - 1, len(sequences[r][1])
                    trainer_lp[r, start : start + n] = log_probs[j, :n].detach().cpu()
            else:
                trainer_lp[live, : log_probs.shape[1]] = log_probs.detach().cpu()
            trained[live] = True
        old = mb.get("old_log_probs", log_probs.detach())
        loss, meta = grpo_microbatch_train_step(
            log_probs, mb["response_mask"], len(plans), cfg.loss_type,
            raw_rewards=mb["raw_rewards"], advantages=mb["advantages"], old_log_probs=old,
            cliprange=cfg.cliprange, cliprange_high=cfg.cliprange_high,
            length_normalization=cfg.length_normalization, normalize_constant=normalize_constant,
            global_num_tokens=global_tokens, global_batch_size=len(rows),
            ref_log_probs=mb.get("ref_log_probs"), kl_coef=kl_coef, kl_estimator_name=cfg.kl_estimator,
        )
        # figures stay on the device until the optimizer step: one sync per step, not per micro-batch
        mask = mb["response_mask"]
        n_tok = mask.sum()
        sums["loss"] += loss
        sums["tokens"] += n_tok
        sums["entropy"] += (entropy.detach().float() * mask).sum()
        sums["approx_kl"] += (kl_k3(old, log_probs.detach()) * mask).sum()
        if "clip_fraction" in meta:
            sums["clip"] += meta["clip_fraction"] * n_tok
        if "kl" in meta:
            sums["kl"] += meta["kl"] * n_tok
    return {k: float(v) for k, v in sums.items()}


def _shared_prefix_microbatch(model, batch, live, sequences, device, autocast):
    """Log-probs of ``live`` rows with each distinct prompt computed once; per-token tensors of the
    micro-batch (mask, old/ref log-probs) come back in the same response layout."""
    distinct: dict[int, int] = {}
    prompts, prompt_of_row = [], []
    for r in live:
        p_ids, _, p_index = sequences[r]
        if p_index not in distinct:
            distinct[p_index] = len(prompts)
            prompts.append(p_ids)
        prompt_of_row.append(distinct[p_index])
    with autocast():
        out = shared_prefix_response_log_probs(
            model, prompts, [sequences[r][1] for r in live], prompt_of_row, batch["pad_id"], device, return_token_entropy=True)
    index = torch.tensor(live)
    p_lens = [len(sequences[r][0]) for r in live]
    r_lens = [len(sequences[r][1]) for r in live]
    mb = {"response_mask": out["response_mask"], "advantages": batch["advantages"][index].to(device),
          "raw_rewards": batch["raw_rewards"][index].to(device)}
    for key in ("old_log_probs", "ref_log_probs"):
        if key in batch:
            mb[key] = label_to_response_layout(batch[key][index], p_lens, r_lens).to(device)
    return mb, out["log_probs"].float(), out["token_entropy"]


# ---------------------------------------------------------------- the loop


def train_grpo(cfg: GRPOConfig, *, model=None, tokenizer=None, resume: bool = False) -> TrainResult:
    """Run GRPO as configured. ``model``/``tokenizer`` override ``cfg.model`` (e.g. after SFT);
    ``resume`` continues from the newest checkpoint in ``cfg.run_dir``."""
    wall = time.perf_counter()
    run, ckpts, resume_from, device, model, tokenizer = start_run(cfg, resume, model, tokenizer)
    autocast = autocast_for(cfg.dtype, device)
    train_examples, eval_examples, template, reward_fn = load_inputs(cfg)
    scorer = RewardScorer(reward_fn, timeout_s=cfg.reward_timeout_s, num_workers=cfg.reward_workers)
    ref_model = None
    if cfg.kl_coef > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if resume_from is not None:
            ref_model.load_state_dict(CheckpointManager.load_state(resume_from)["reference_model"])

    steps_per_rollout = cfg.rollout_batch_size // cfg.train_batch_size * cfg.epochs_per_rollout_batch
    total_opt_steps = cfg.n_grpo_steps * steps_per_rollout
    optimizer = make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, effective_warmup(cfg.warmup_steps, total_opt_steps), total_opt_steps, cfg.lr_schedule)
    kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon, cfg.kl_coef_min, cfg.kl_coef_max)
              if cfg.kl_adaptive else FixedKLController(cfg.kl_coef))
    sample_gen = torch.Generator().manual_seed(cfg.seed)
    backend = make_backend(cfg.rollout_backend, model, tokenizer, max_batch_size=cfg.rollout_max_batch_size,
                           autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None, generator=sample_gen)
    sampler = ExampleSampler(len(train_examples), cfg.seed)
    health = HealthMonitor(cfg.health_window, cfg.truncation_threshold, stop_on_unhealthy=cfg.stop_on_unhealthy)
    sampling = cfg.sampling_params()
    eval_sampling = cfg.eval_sampling_params()
    normalize_constant = cfg.normalize_constant or float(cfg.sampling_max_tokens)
    pad_id = pad_token_id(tokenizer)

    start_step, train_step, eval_step = 0, 0, 0
    if resume_from is not None:
        state = CheckpointManager.load_state(resume_from)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        kl_ctl.load_state_dict(state["kl_controller"])
        sampler.load_state_dict(state["data"])
        restore_rng(state["rng"], {"sampling": sample_gen})
        start_step, train_step, eval_step = state["grpo_step"], state["train_step"], state["eval_step"]
    logger = MetricsLogger(run.metrics_path, cfg.report_to, run_name=run.path.name, config=cfg.to_dict())

    def run_eval(step: int) -> dict[str, float]:
        nonlocal eval_step
        if not eval_examples:
            return {}
        result = evaluate(backend, eval_examples, template, reward_fn, eval_sampling, scorer=scorer)
        extra = log_generations(run.path / "samples" / f"eval_step_{step}.jsonl", result, step, model, tokenizer,
                                cfg.log_generations_samples) if cfg.log_generations_samples else {}
        record = {"eval_step": eval_step, "grpo_step": step, **{f"eval/{k}": v for k, v in {**result.metrics, **extra}.items()}}
        logger.log(record)
        eval_step += 1
        return result.metrics

    before = run_eval(start_step) if start_step == 0 else None
    bar = progress(cfg.n_grpo_steps, "GRPO", cfg.show_progress, initial=start_step)
    n_prompts = cfg.rollout_batch_size // cfg.group_size

    for step in range(start_step, cfg.n_grpo_steps):
        # 1. sample a group of responses per question
        t_rollout = time.perf_counter()
        examples = [train_examples[i] for i in sampler.next(n_prompts)]
        rollouts = backend.generate([template.format(e.question) for e in examples], cfg.group_size, sampling)
        rollout_s = time.perf_counter() - t_rollout

        # 2. score them and normalise within each group
        ground_truths = [examples[r.prompt_index].answer for r in rollouts]
        errors_before = scorer.errors
        scores = scorer.score([r.response for r in rollouts], ground_truths)
        raw_rewards = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
        advantages = normalize_group_rewards(raw_rewards, cfg.group_size, cfg.advantage_eps, cfg.use_std_normalization)
        if cfg.whiten_advantages:
            advantages = whiten(advantages, torch.ones_like(advantages, dtype=torch.bool)) if len(advantages) > 1 else advantages

        # 3. the exact sampled ids, right-padded; old and reference log-probs once per rollout batch
        t_train = time.perf_counter()
        batch = build_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad_id)
        batch["advantages"] = advantages.unsqueeze(1)
        batch["raw_rewards"] = raw_rewards.unsqueeze(1)
        batch["pad_id"] = pad_id
        sequences = [(r.prompt_ids, r.response_ids, r.prompt_index) for r in rollouts]
        rows_per_pass = max(1, cfg.train_batch_size // cfg.gradient_accumulation_steps)
        if cfg.off_policy:
            batch["old_log_probs"] = batched_log_probs(model, batch, rows_per_pass, device, autocast)
        if ref_model is not None:
            batch["ref_log_probs"] = batched_log_probs(ref_model, batch, rows_per_pass, device, autocast)
        # trainer log-probs of the sampled tokens, for the sampler/trainer mismatch check
        trainer_lp = batch["old_log_probs"] if cfg.off_policy else torch.zeros(batch["labels"].shape)
        trained = torch.full((cfg.rollout_batch_size,), cfg.off_policy, dtype=torch.bool)
        signal = raw_rewards if cfg.loss_type == "no_baseline" else advantages
        has_tokens = batch["response_mask"].any(1)  # an empty response never reaches the loss (0/0)
        contributes = has_tokens & ((signal != 0) | (ref_model is not None and kl_ctl.value > 0) | (not cfg.skip_zero_advantage))

        # 4. epochs over the rollout batch in optimizer batches of micro-batches
        step_records, stopped_early, kl_values = [], False, []
        for epoch in range(cfg.epochs_per_rollout_batch):
            for b0 in range(0, cfg.rollout_batch_size, cfg.train_batch_size):
                rows = list(range(b0, b0 + cfg.train_batch_size))
                record_lp = (trainer_lp, trained) if epoch == 0 and not cfg.off_policy else None
                sums = accumulate_policy_gradient(model, batch, rows, cfg, contributes, kl_ctl.value, device,
                                                  autocast, normalize_constant, record_lp, sequences)
                grad_norm = optimizer_step(model, optimizer, scheduler, cfg.max_grad_norm)
                tok = max(sums["tokens"], 1.0)
                approx_kl = sums["approx_kl"] / tok
                record = {
                    "train_step": train_step, "grpo_step": step, "epoch": epoch,
                    "train/loss": sums["loss"], "train/grad_norm": grad_norm, "train/token_entropy": sums["entropy"] / tok,
                    "train/clip_fraction": sums["clip"] / tok, "train/approx_kl_old_new": approx_kl,
                    "train/lr": scheduler.get_last_lr()[0], "train/kl_coef": kl_ctl.value,
                    "train/rows_trained": int(sum(bool(contributes[r]) for r in rows)),
                }
                if ref_model is not None:
                    record["train/kl"] = sums["kl"] / tok
                    kl_values.append(sums["kl"] / tok)
                step_records.append(record)
                train_step += 1
                if cfg.kl_stop is not None and cfg.off_policy and approx_kl > cfg.kl_stop:
                    stopped_early = True
                    break
            if stopped_early:
                break
        if kl_values:
            kl_ctl.update(sum(kl_values) / len(kl_values), cfg.rollout_batch_size)
        train_s = time.perf_counter() - t_train

        # 5. health figures, metrics, diagnosis
        mask = batch["response_mask"]
        sampler_lp = sampler_logprob_tensor(rollouts, mask.shape)
        checked = mask & trained.unsqueeze(1)
        n_done = sum(len(r.response_ids) for r in rollouts)
        fmt = torch.tensor([s.get("format_reward", 1.0) for s in scores])
        ans = torch.tensor([s.get("answer_reward", s["reward"]) for s in scores])
        grouped = raw_rewards.view(-1, cfg.group_size)
        lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32)
        correct = raw_rewards >= 1.0
        health_m = {
            "zero_variance_group_fraction": float((grouped.max(1).values == grouped.min(1).values).float().mean()),
            "truncation_rate": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
            "format_failure_rate": float(1 - fmt.mean()),
            "wrong_answer_rate": float(((fmt > 0) & (ans <= 0)).float().mean()),
            "reward_errors": scorer.errors - errors_before,
            "logprob_mismatch": float(masked_mean((sampler_lp - trainer_lp).abs(), checked)) if checked.any() else 0.0,
            "reward_mean": float(raw_rewards.mean()),
        }
        rollout_m = {
            "train/reward": float(raw_rewards.mean()), "train/reward_std": float(raw_rewards.std()) if len(raw_rewards) > 1 else 0.0,
            "train/format_reward": float(fmt.mean()), "train/answer_reward": float(ans.mean()),
            "train/response_length": float(lengths.mean()),
            "train/response_length_correct": float(lengths[correct].mean()) if correct.any() else 0.0,
            "train/response_length_incorrect": float(lengths[~correct].mean()) if (~correct).any() else 0.0,
            "train/kl_early_stop": int(stopped_early),
            **{f"health/{k}": v for k, v in health_m.items() if k != "reward_mean"},
            "time/rollout_s": rollout_s, "time/train_s": train_s,
            "time/tokens_per_s": n_done / max(rollout_s + train_s, 1e-9),
        }
        for k in scores[0]:
            if k not in ("reward", "format_reward", "answer_reward"):
                rollout_m[f"train/reward_{k}"] = sum(s.get(k, 0.0) for s in scores) / len(scores)
        for i, record in enumerate(step_records):
            logger.log({**record, **(rollout_m if i == 0 else {})})
        for message in health.update({**health_m, "last_reward_error": scorer.last_error}):
            bar.write(f"grpolab health: {message}")
        bar.set_postfix(reward=f"{health_m['reward_mean']:.3f}", loss=f"{step_records[-1]['train/loss']:.4f}" if step_records else "-")
        bar.update(1)

        # 6. periodic validation and checkpoints
        done = step + 1
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.n_grpo_steps:
            run_eval(done)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
            state = {
                "grpo_step": done, "train_step": train_step, "eval_step": eval_step,
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "kl_controller": kl_ctl.state_dict(), "data": sampler.state_dict(),
                "rng": rng_state({"sampling": sample_gen}), "config": cfg.to_dict(),
            }
            if ref_model is not None:
                state["reference_model"] = ref_model.state_dict()
            ckpts.save(done, model, tokenizer, state)
    bar.close()

    after = run_eval(cfg.n_grpo_steps)
    save_model_and_tokenizer(model, tokenizer, run.final)
    logger.close()
    scorer.close()
    plot_grpo_run(run.metrics_path, run.path / "curves.png", f"GRPO: {run.path.name}")
    return TrainResult(run.path, run.final, run.metrics_path, after, time.perf_counter() - wall, before=before)
