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

import time

import torch
from pydantic import Field
from safetensors.torch import save_file

from ..core import (
    aggregate_token_loss,
    build_sequences,
    compute_gae,
    compute_grpo_clip_loss,
    compute_value_loss,
    kl_k1,
    kl_k3,
    masked_mean,
    pad_token_id,
    whiten,
)
from ..models.fused_head import response_log_probs
from ..rewards import RewardScorer
from ..rollout import make_backend
from ..training.batching import ExampleSampler, optimizer_batch_count, optimizer_batches, plan_microbatches, take_rows
from ..training.inputs import load_inputs
from ..training.optimization import effective_warmup, make_optimizer, make_scheduler
from ..training.resources import check_sampled_inputs
from ..training.run import Run, TrainResult
from ..training.run_model import frozen_copy
from ..training.sampled_run_config import PolicyUpdateConfig
from ..training.token_records import TokenRecorder, empty_stats, sampler_log_probs
from ..training.validation import validation


class PPOConfig(PolicyUpdateConfig):
    """PPO's fields beside those it shares with GRPO (``PolicyUpdateConfig``, with PPO's own defaults)."""

    command, steps_field, step_key = "ppo", "n_ppo_steps", "ppo_step"
    trains_value_head = True  # the critic beside the policy, outside the engine's wrapping
    # PPO's own defaults for the fields it shares with GRPO: 64 responses per step, one per question
    # (group_size 1: plain PPO), minibatches of 32, whitened advantages, and the seed design's KL:
    # 0.2, adaptive within [0.1, 0.3] toward a summed per-sequence KL of 6 (Ziegler et al.); 0 = no KL.
    method_defaults = dict(rollout_batch_size=64, group_size=1, train_batch_size=32, gradient_accumulation_steps=1,
                           warmup_steps=0, whiten_advantages=True, kl_coef=0.2, kl_adaptive=True, kl_target=6.0,
                           kl_stop=0.3)
    # --- PPO: value function and GAE
    n_ppo_steps: int = Field(100, ge=1)
    """Outer steps: each samples a rollout batch, scores it and updates the policy and value head on it."""
    ppo_epochs: int = Field(4, ge=1)
    """Passes over each rollout batch, in shuffled minibatches of train_batch_size."""
    cliprange_value: float | None = Field(0.2, gt=0)
    """The value loss's clip: a new value may move at most this far from the old one (null: unclipped)."""
    vf_coef: float = Field(0.1, ge=0)
    """The value loss's weight beside the clipped policy loss."""
    gamma: float = Field(0.99, ge=0, le=1)
    """GAE's discount per token (1.0 is the other common choice for LMs: the only non-KL reward is at the end)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE's lambda: the bias/variance trade-off of the advantages."""
    run_dir: str = "runs/ppo"


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
    """A causal LM plus a value head sharing its trunk: one forward gives log-probs (of the
    tempered policy softmax(logits / temperature)), entropy and values."""

    def __init__(self, lm, temperature: float = 1.0):
        super().__init__()
        self.lm, self.temperature = lm, temperature
        self.value_head = ValueHead(lm.config.hidden_size)

    def forward(self, input_ids, labels, return_entropy: bool = False):
        out = response_log_probs(self.lm, input_ids, labels, return_entropy, temperature=self.temperature,
                                 return_last_hidden=True)
        return out["log_probs"], out.get("token_entropy"), self.value_head(out["last_hidden_state"])


def ppo_minibatch_step(policy, mb: dict, cfg: PPOConfig, n_micro: int, global_tokens, rows: list[int] | None = None,
                       token_stats: dict | None = None) -> dict[str, torch.Tensor]:
    """Clipped policy loss + vf_coef x clipped value loss on one micro-batch, token-mean over the
    minibatch's response tokens; backward once. Returns summed figures for logging; ``token_stats``
    (``token_records.empty_stats``) gets the entropy, ratio and clip flag of each token of ``rows``."""
    log_probs, entropy, values = policy(mb["input_ids"], mb["labels"], return_entropy=True)
    mask = mb["response_mask"]
    pg, pg_meta = compute_grpo_clip_loss(mb["advantages"], log_probs, mb["old_log_probs"], cfg.cliprange)
    vf, vf_meta = compute_value_loss(values, mb["old_values"], mb["returns"], cfg.cliprange_value)
    loss = aggregate_token_loss(pg + cfg.vf_coef * vf, mask, n_micro, "token_mean", global_num_tokens=global_tokens)
    loss.backward()
    if token_stats is not None:
        for key, values in (("entropy", entropy), ("ratio", pg_meta["ratio"]), ("clipped", pg_meta["clipped"])):
            token_stats[key][rows, : values.shape[1]] = values.detach().float().cpu()
    return {
        "loss": loss.detach(), "tokens": mask.sum(), "pg_loss": (pg.detach() * mask).sum(),
        "value_loss": (vf.detach() * mask).sum(), "clip": (pg_meta["clipped"].float() * mask).sum(),
        "value_clip": (vf_meta["clipped"].float() * mask).sum(), "entropy": (entropy.detach() * mask).sum(),
        "approx_kl": (kl_k3(mb["old_log_probs"], log_probs.detach()) * mask).sum(),
    }


@torch.inference_mode()
def score_tokens(policy, ref, batch: dict, score: torch.Tensor, kl_coef: float, cfg: PPOConfig, device, autocast):
    """Old log-probs and values, per-token rewards (-kl_coef x k1 KL to the reference at every
    response token, the verifier's score at the last one), then GAE advantages and returns."""
    mask = batch["response_mask"]
    with autocast():
        old_lp, _, old_values = policy(batch["input_ids"].to(device), batch["labels"].to(device))
    old_lp, old_values = old_lp.float().cpu(), old_values.float().cpu() * mask
    kl = torch.zeros_like(old_lp)
    if ref is not None:
        with autocast():
            ref_lp = response_log_probs(ref, batch["input_ids"].to(device), batch["labels"].to(device),
                                        temperature=policy.temperature)["log_probs"]
        kl = kl_k1(old_lp, ref_lp.float().cpu()) * mask
    rewards = -kl_coef * kl
    last = mask.long().cumsum(1).argmax(1)  # index of each row's last response token
    has = mask.any(1)
    rewards[has, last[has]] += score[has]
    advantages, returns = compute_gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages and mask.sum() > 1:
        advantages = whiten(advantages, mask)
    batch.update(old_log_probs=old_lp, old_values=old_values, advantages=advantages, returns=returns)
    return kl


def ppo_update(run: Run, policy, batch: dict, cfg: PPOConfig, optimizer, scheduler, step: int,
               token_stats: dict | None = None) -> tuple[dict, int]:
    """``ppo_epochs`` passes over shuffled minibatches; the approx KL(old || current) of each
    minibatch is measured before its optimizer step, which is not applied once it exceeds kl_stop.
    Returns the summed figures and the optimizer steps the KL early stop skipped (0: it did not fire),
    said in one line."""
    mask = batch["response_mask"]
    has = mask.any(1)
    sums: dict[str, float] = {}
    g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    planned, taken = cfg.ppo_epochs * optimizer_batch_count(cfg.rollout_batch_size, cfg.train_batch_size), 0
    for epoch in range(cfg.ppo_epochs):
        for rows in optimizer_batches(cfg.rollout_batch_size, cfg.train_batch_size, True, g):
            taken += 1
            rows = [r for r in rows if has[r]]
            if not rows:
                continue
            global_tokens = mask[rows].sum().clamp(min=1)
            mb_sums: dict[str, torch.Tensor] = {}
            for plan in plan_microbatches([1] * len(rows), cfg.gradient_accumulation_steps):
                mb_rows = [rows[i] for i in plan]
                mb = take_rows(batch, mb_rows, run.device)
                with run.autocast():
                    for k, v in ppo_minibatch_step(policy, mb, cfg, cfg.gradient_accumulation_steps, global_tokens,
                                                   mb_rows, token_stats).items():
                        mb_sums[k] = mb_sums.get(k, 0.0) + v
            f = {k: float(v) for k, v in mb_sums.items()}
            tok = max(f["tokens"], 1.0)
            if cfg.kl_stop is not None and f["approx_kl"] / tok > cfg.kl_stop:
                optimizer.zero_grad(set_to_none=True)  # measured before the step: not applied
                skipped = planned - taken + 1
                run.bar.write(f"grpolab health: ppo step {step}: KL early stop (approx KL(old || current) "
                              f"{f['approx_kl'] / tok:.4g} > kl_stop {cfg.kl_stop}): {skipped} of {planned} "
                              "optimizer updates of this rollout batch skipped (kl_stop: null turns it off)")
                return sums, skipped
            result = run.optimizer_step(optimizer, scheduler, f["loss"], parameters_of=policy)
            run.log_update({"train_step": run.train_step, "ppo_step": step, "epoch": epoch,
                            "train/pg_loss": f["pg_loss"] / tok, "train/value_loss": f["value_loss"] / tok,
                            "train/clip_fraction": f["clip"] / tok, "train/value_clip_fraction": f["value_clip"] / tok,
                            "train/token_entropy": f["entropy"] / tok, "train/approx_kl_old_new": f["approx_kl"] / tok},
                           result, optimizer)
            run.train_step += 1
            for k, v in f.items():
                sums[k] = sums.get(k, 0.0) + v
    return sums, 0


def step_metrics(step: int, score: torch.Tensor, scores: list[dict], seq_kl: float, kl_coef: float, sums: dict,
                 batch: dict, stopped: int, nonfinite_steps: int) -> dict[str, float]:
    """A PPO step's figures: reward, KL to the reference and its coefficient, value loss, returns and
    values, the KL early stop, response length, skipped steps, and the reward's components."""
    mask = batch["response_mask"]
    return {
        "ppo_step": step, "train/reward": float(score.mean()), "train/kl_to_ref": seq_kl, "train/kl_coef": kl_coef,
        "train/value_loss_mean": sums.get("value_loss", 0.0) / max(sums.get("tokens", 0.0), 1.0),
        "train/returns_mean": float(masked_mean(batch["returns"], mask)) if mask.any() else 0.0,
        "train/values_mean": float(masked_mean(batch["old_values"], mask)) if mask.any() else 0.0,
        "train/kl_early_stop": int(stopped > 0), "train/skipped_updates_kl_stop": stopped,
        "train/skipped_updates": stopped,  # plus each update record's own (non-finite): summed, the step's skips
        "train/response_length": float(mask.sum(1).float().mean()),
        "health/nonfinite_steps": nonfinite_steps,
        **{f"train/reward_{k}": sum(s.get(k, 0.0) for s in scores) / len(scores) for k in scores[0] if k != "reward"},
    }


def train_ppo(
    cfg: PPOConfig, *, model=None, tokenizer=None, resume: bool = False, overwrite: bool = False
) -> TrainResult:
    """Run PPO as configured; ``resume`` continues from the newest checkpoint in ``cfg.run_dir``."""
    inputs = load_inputs(cfg, tokenizer)
    with Run(cfg, resume=resume, overwrite=overwrite, model=model, tokenizer=tokenizer,
             check_inputs=check_sampled_inputs(inputs, cfg)) as run:
        model, tokenizer = run.model, run.tokenizer
        policy = PolicyWithValue(model, cfg.policy_temperature).to(run.device)
        run.track("value_head", policy.value_head)
        ref = run.track("reference_model", frozen_copy(model)) if cfg.kl_coef > 0 else None
        scorer = RewardScorer(inputs.reward, timeout_s=cfg.reward_timeout_s, num_workers=cfg.reward_workers,
                              device=run.device)
        if scorer.model_reward is not None:  # reward models' running normalisation, for an exact resume
            run.track("reward_normalization", scorer)
        total_updates = cfg.n_ppo_steps * cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.train_batch_size)
        optimizer = run.track("optimizer", make_optimizer(policy, cfg.learning_rate, cfg.betas, cfg.weight_decay))
        scheduler = run.track("scheduler", make_scheduler(
            optimizer, effective_warmup(cfg.warmup_steps, total_updates), total_updates, cfg.lr_schedule))
        kl_ctl = run.track("kl_controller", cfg.kl_controller())
        questions = run.track("data", ExampleSampler(len(inputs.train), cfg.seed))
        generator = run.track_rng("sampling", torch.Generator().manual_seed(cfg.seed))
        backend = make_backend("hf", run.sampling_model, tokenizer, generator=generator,
                               max_batch_size=cfg.rollout_max_batch_size,
                               autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None)
        sampling, pad = cfg.sampling_params(), pad_token_id(tokenizer)
        recorder = TokenRecorder(run.path, cfg.token_record_groups, cfg.seed, enabled=run.is_main,
                                 resume_step=run.step if run.resuming else None)
        validate = validation(run, backend, inputs, cfg, scorer)
        before = validate(0) if not run.resuming else None
        for step in run.steps():
            t0 = time.perf_counter()
            batch_q = [inputs.train[i] for i in questions.next(cfg.rollout_batch_size // cfg.group_size)]
            rollouts = backend.generate([inputs.template.format(e.question) for e in batch_q], cfg.group_size, sampling)
            answers = [batch_q[r.prompt_index].answer for r in rollouts]
            scores = scorer.score([r.scored_response for r in rollouts], answers, prompts=[r.prompt for r in rollouts],
                                  questions=[batch_q[r.prompt_index].question for r in rollouts], rollouts=rollouts)
            score = torch.tensor([s["reward"] for s in scores])
            rollout_s = time.perf_counter() - t0
            batch = build_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad)
            kl = score_tokens(policy, ref, batch, score, kl_ctl.value, cfg, run.device, run.autocast)
            stats = empty_stats(batch["labels"].shape) if recorder.groups else None  # per-token figures for the viewer
            sums, stopped = ppo_update(run, policy, batch, cfg, optimizer, scheduler, step, stats)
            t2 = time.perf_counter()
            if stats:
                recorder.record(step, rollouts, scores, cfg.group_size, tokenizer,
                                {"sampler_lp": sampler_log_probs(rollouts, batch["labels"].shape),
                                 "trainer_lp": batch["old_log_probs"], **stats},
                                batch["advantages"], batch_q)
            record_s = time.perf_counter() - t2
            seq_kl = float(kl.sum(1).mean())
            kl_ctl.update(seq_kl, cfg.rollout_batch_size)
            figures = step_metrics(step, score, scores, seq_kl, kl_ctl.value, sums, batch, stopped, run.nonfinite_steps)
            run.log({**figures,
                     "time/rollout_s": rollout_s, "time/train_s": time.perf_counter() - t0 - rollout_s - record_s,
                     "time/token_records_s": record_s})
            run.bar.set_postfix(reward=f"{float(score.mean()):.3f}")
            run.end_step(step + 1, validate)
        after = validate(cfg.n_ppo_steps)
        scorer.close()
        value_head = {k: v.contiguous() for k, v in policy.value_head.state_dict().items()}
        return run.finish(after, before=before,
                          extra_files=lambda d: save_file(value_head, str(d / "value_head.safetensors")))
