"""PPO for language models with a learned value function and GAE: the RLHF baseline GRPO is
measured against (Schulman et al. 2017; Ziegler et al. 2019; Ouyang et al. 2022).

Per step: sample ``rollout_batch_size`` responses (``group_size`` per question); per-token rewards
are the verifier's reward on the last response token minus ``kl_coef`` x the per-token KL to a
frozen reference model; a value head on the policy's last hidden state estimates V; advantages and
returns come from ``compute_gae`` (gamma, lam), advantages are whitened; then ``ppo_epochs`` passes
of clipped policy loss + ``vf_coef`` x clipped value loss over minibatches of ``train_batch_size``,
stopping early once approx KL(old || new) exceeds ``kl_stop``. The KL coefficient follows the same
adaptive controller as GRPO (Ziegler et al.'s, clamped to [``kl_coef_min``, ``kl_coef_max``]).
Defaults: gamma 0.99 and lam 0.95 as in the seed design (gamma 1.0, lam 0.95 is the other common
choice for LMs, where the only non-KL reward is at the end).
"""

from __future__ import annotations

import copy
import time
from typing import Literal

import torch
from pydantic import Field, model_validator
from safetensors.torch import save_file

from ..core import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_token_loss,
    build_sequences,
    compute_gae,
    compute_grpo_clip_loss,
    compute_value_loss,
    kl_k1,
    kl_k3,
    log_probs_from_logits,
    masked_mean,
    pad_token_id,
    whiten,
)
from ..eval import evaluate
from ..models import save_model_and_tokenizer
from ..rewards import RewardScorer
from ..rollout import make_backend
from .config import SampledRunConfig
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
    progress,
    restore_rng,
    rng_state,
    start_run,
    take_rows,
)


class PPOConfig(SampledRunConfig):
    # --- PPO
    n_ppo_steps: int = Field(100, ge=1)
    rollout_batch_size: int = Field(64, ge=1)
    group_size: int = Field(1, ge=1)  # responses per question (1: plain PPO)
    ppo_epochs: int = Field(4, ge=1)
    train_batch_size: int = Field(32, ge=1)  # minibatch
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-5, gt=0)
    cliprange: float = Field(0.2, gt=0)
    cliprange_value: float | None = Field(0.2, gt=0)
    vf_coef: float = Field(0.1, ge=0)
    gamma: float = Field(0.99, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    whiten_advantages: bool = True
    kl_coef: float = Field(0.2, ge=0)  # the seed design: 0.2, adaptive within [0.1, 0.3]
    kl_adaptive: bool = True
    kl_target: float = Field(6.0, gt=0)  # summed per-sequence KL the controller aims at (Ziegler et al.)
    kl_horizon: int = Field(10000, ge=1)
    kl_coef_min: float = Field(0.1, ge=0)
    kl_coef_max: float = Field(0.3, ge=0)
    kl_stop: float | None = Field(0.3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    eval_every: int = Field(0, ge=0)
    checkpoint_every: int = Field(0, ge=0)  # PPO steps between checkpoints (0: only the final model)
    keep_last: int = Field(2, ge=1)
    run_dir: str = "runs/ppo"

    @model_validator(mode="after")
    def _check(self):
        if self.rollout_batch_size % self.group_size:
            raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must be divisible by group_size ({self.group_size})")
        if self.rollout_batch_size % self.train_batch_size:
            raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must be divisible by train_batch_size ({self.train_batch_size})")
        if self.kl_coef_min > self.kl_coef_max:
            raise ValueError(f"kl_coef_min ({self.kl_coef_min}) exceeds kl_coef_max ({self.kl_coef_max})")
        return self


class ValueHead(torch.nn.Module):
    """V(s) from the policy's last hidden state; zero-initialised so early values are 0."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.float()).squeeze(-1)


class PolicyWithValue(torch.nn.Module):
    """A causal LM plus a value head sharing its trunk: one forward gives log-probs, entropy, values."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.value_head = ValueHead(lm.config.hidden_size)

    def forward(self, input_ids, labels, return_entropy: bool = False):
        out = self.lm(input_ids, output_hidden_states=True)
        log_probs, entropy = log_probs_from_logits(out.logits, labels, return_entropy)
        return log_probs, entropy, self.value_head(out.hidden_states[-1])


def ppo_minibatch_step(policy, mb: dict, cfg: PPOConfig, n_micro: int, global_tokens) -> dict[str, float]:
    """Clipped policy loss + vf_coef x clipped value loss on one micro-batch, token-mean over the
    minibatch's response tokens; backward once. Returns figures for logging."""
    log_probs, entropy, values = policy(mb["input_ids"], mb["labels"], return_entropy=True)
    mask = mb["response_mask"]
    pg, pg_meta = compute_grpo_clip_loss(mb["advantages"], log_probs, mb["old_log_probs"], cfg.cliprange)
    vf, vf_meta = compute_value_loss(values, mb["old_values"], mb["returns"], cfg.cliprange_value)
    per_token = pg + cfg.vf_coef * vf
    loss = aggregate_token_loss(per_token, mask, n_micro, "token_mean", global_num_tokens=global_tokens)
    loss.backward()
    n = float(mask.sum())
    return {
        "tokens": n,
        "pg_loss": float((pg.detach() * mask).sum()),
        "value_loss": float((vf.detach() * mask).sum()),
        "clip": float((pg_meta["clipped"].float() * mask).sum()),
        "value_clip": float((vf_meta["clipped"].float() * mask).sum()),
        "entropy": float((entropy.detach() * mask).sum()),
        "approx_kl": float((kl_k3(mb["old_log_probs"], log_probs.detach()) * mask).sum()),
    }


def train_ppo(cfg: PPOConfig, *, model=None, tokenizer=None, resume: bool = False) -> TrainResult:
    """Run PPO as configured; ``resume`` continues from the newest checkpoint in ``cfg.run_dir``."""
    wall = time.perf_counter()
    run, ckpts, resume_from, device, model, tokenizer = start_run(cfg, resume, model, tokenizer)
    autocast = autocast_for(cfg.dtype, device)
    policy = PolicyWithValue(model).to(device)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    state = CheckpointManager.load_state(resume_from) if resume_from is not None else None
    if state is not None:  # the reference is the starting policy, not the checkpoint
        ref.load_state_dict(state["reference_model"])
        policy.value_head.load_state_dict(state["value_head"])
    train, evals, template, reward_fn = load_inputs(cfg)
    scorer = RewardScorer(reward_fn, timeout_s=0)
    n_minibatches = cfg.rollout_batch_size // cfg.train_batch_size
    total_updates = cfg.n_ppo_steps * cfg.ppo_epochs * n_minibatches
    optimizer = make_optimizer(policy, cfg.learning_rate, cfg.betas, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, effective_warmup(cfg.warmup_steps, total_updates), total_updates, cfg.lr_schedule)
    kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon, cfg.kl_coef_min, cfg.kl_coef_max)
              if cfg.kl_adaptive else FixedKLController(cfg.kl_coef))
    backend = make_backend("hf", model, tokenizer, generator=torch.Generator().manual_seed(cfg.seed),
                           autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None)
    sampling = cfg.sampling_params()
    eval_sampling = cfg.eval_sampling_params()
    questions = ExampleSampler(len(train), cfg.seed)
    sample_gen = backend.generator
    start_step, train_step, eval_step = 0, 0, 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        kl_ctl.load_state_dict(state["kl_controller"])
        questions.load_state_dict(state["data"])
        restore_rng(state["rng"], {"sampling": sample_gen})
        start_step, train_step, eval_step = state["ppo_step"], state["train_step"], state["eval_step"]
    logger = MetricsLogger(run.metrics_path)
    pad = pad_token_id(tokenizer)

    def run_eval(step: int) -> dict[str, float]:
        nonlocal eval_step
        if not evals:
            return {}
        m = evaluate(backend, evals, template, reward_fn, eval_sampling).metrics
        logger.log({"eval_step": eval_step, "ppo_step": step, **{f"eval/{k}": v for k, v in m.items()}})
        eval_step += 1
        return m

    before = run_eval(0) if start_step == 0 else None
    bar = progress(cfg.n_ppo_steps, "PPO", cfg.show_progress, initial=start_step)
    for step in range(start_step, cfg.n_ppo_steps):
        t0 = time.perf_counter()
        batch_q = [train[i] for i in questions.next(cfg.rollout_batch_size // cfg.group_size)]
        rollouts = backend.generate([template.format(e.question) for e in batch_q], cfg.group_size, sampling)
        scores = scorer.score([r.response for r in rollouts], [batch_q[r.prompt_index].answer for r in rollouts])
        score = torch.tensor([s["reward"] for s in scores])
        rollout_s = time.perf_counter() - t0

        # old log-probs, old values, reference log-probs: once per rollout batch
        batch = build_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad)
        mask = batch["response_mask"]
        with torch.inference_mode(), autocast():
            old_lp, _, old_values = policy(batch["input_ids"].to(device), batch["labels"].to(device))
            ref_out = ref(batch["input_ids"].to(device)).logits
            ref_lp, _ = log_probs_from_logits(ref_out, batch["labels"].to(device), False)
        old_lp, old_values, ref_lp = old_lp.float().cpu(), old_values.float().cpu() * mask, ref_lp.float().cpu()
        # per-token rewards: -kl_coef * KL at every response token, the verifier's score at the last one
        kl = kl_k1(old_lp, ref_lp) * mask
        rewards = -kl_ctl.value * kl
        last = mask.long().cumsum(1).argmax(1)  # index of each row's last response token
        has = mask.any(1)
        rewards[has, last[has]] += score[has]
        advantages, returns = compute_gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages and mask.sum() > 1:
            advantages = whiten(advantages, mask)
        batch.update(old_log_probs=old_lp, old_values=old_values, advantages=advantages, returns=returns)

        # ppo_epochs passes over shuffled minibatches, stopping early on a large policy change
        sums = {k: 0.0 for k in ("tokens", "pg_loss", "value_loss", "clip", "value_clip", "entropy", "approx_kl")}
        stopped = False
        g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
        for epoch in range(cfg.ppo_epochs):
            order = torch.randperm(cfg.rollout_batch_size, generator=g).tolist()
            for mb0 in range(0, cfg.rollout_batch_size, cfg.train_batch_size):
                rows = order[mb0 : mb0 + cfg.train_batch_size]
                rows = [r for r in rows if has[r]]
                if not rows:
                    continue
                global_tokens = mask[rows].sum().clamp(min=1)
                micro = max(1, len(rows) // cfg.gradient_accumulation_steps)
                mb_sums = {k: 0.0 for k in sums}
                for m0 in range(0, len(rows), micro):
                    mb = take_rows(batch, rows[m0 : m0 + micro], device)
                    with autocast():
                        figures = ppo_minibatch_step(policy, mb, cfg, cfg.gradient_accumulation_steps, global_tokens)
                    for k, v in figures.items():
                        mb_sums[k] += v
                grad_norm = optimizer_step(policy, optimizer, scheduler, cfg.max_grad_norm)
                tok = max(mb_sums["tokens"], 1.0)
                logger.log({"train_step": train_step, "ppo_step": step, "epoch": epoch,
                            "train/pg_loss": mb_sums["pg_loss"] / tok, "train/value_loss": mb_sums["value_loss"] / tok,
                            "train/clip_fraction": mb_sums["clip"] / tok, "train/value_clip_fraction": mb_sums["value_clip"] / tok,
                            "train/token_entropy": mb_sums["entropy"] / tok, "train/approx_kl_old_new": mb_sums["approx_kl"] / tok,
                            "train/grad_norm": grad_norm, "train/lr": scheduler.get_last_lr()[0]})
                train_step += 1
                for k, v in mb_sums.items():
                    sums[k] += v
                if cfg.kl_stop is not None and mb_sums["approx_kl"] / tok > cfg.kl_stop:
                    stopped = True
                    break
            if stopped:
                break
        seq_kl = float(kl.sum(1).mean())
        kl_ctl.update(seq_kl, cfg.rollout_batch_size)
        tok = max(sums["tokens"], 1.0)
        logger.log({"ppo_step": step, "train/reward": float(score.mean()), "train/kl_to_ref": seq_kl,
                    "train/kl_coef": kl_ctl.value, "train/value_loss_mean": sums["value_loss"] / tok,
                    "train/returns_mean": float(masked_mean(returns, mask)) if mask.any() else 0.0,
                    "train/values_mean": float(masked_mean(old_values, mask)) if mask.any() else 0.0,
                    "train/kl_early_stop": int(stopped),
                    "train/response_length": float(mask.sum(1).float().mean()),
                    "time/rollout_s": rollout_s, "time/train_s": time.perf_counter() - t0 - rollout_s})
        bar.set_postfix(reward=f"{float(score.mean()):.3f}")
        bar.update(1)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.n_ppo_steps:
            run_eval(step + 1)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            ckpts.save(step + 1, model, tokenizer, {
                "ppo_step": step + 1, "train_step": train_step, "eval_step": eval_step,
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "kl_controller": kl_ctl.state_dict(), "data": questions.state_dict(),
                "rng": rng_state({"sampling": sample_gen}), "config": cfg.to_dict(),
                "value_head": policy.value_head.state_dict(), "reference_model": ref.state_dict()})
    bar.close()
    after = run_eval(cfg.n_ppo_steps)
    save_model_and_tokenizer(model, tokenizer, run.final)
    save_file({k: v.contiguous() for k, v in policy.value_head.state_dict().items()}, str(run.final / "value_head.safetensors"))
    logger.close()
    return TrainResult(run.path, run.final, run.metrics_path, after, time.perf_counter() - wall, before=before)
