"""SFT: maximum-likelihood fine-tuning on (prompt, response) pairs, loss on the response tokens
only (CS336 A5 §4). The hyperparameters are the fields of ``SFTConfig``; the loop is ``train_sft``.

Data: an embedded task's worked solutions, a CS336 ``sft.jsonl`` of ``{prompt, response}``, or a
GSM8K/MATH JSONL (its reference solution in R1-Zero form). ``filter_correct`` keeps only pairs
whose response the verifier accepts (CS336 §4.3); ``max_examples`` sets the dataset size.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
from pydantic import Field

from ..core import (
    get_response_log_probs,
    sft_microbatch_train_step,
    tokenize_prompt_and_output,
)
from ..data import load_examples, load_sft_pairs, load_template
from ..data.datasets import SFTPair
from ..eval import evaluate, log_generations
from ..models import save_model_and_tokenizer
from ..rewards import RewardScorer, build_reward
from ..rollout import make_backend
from .config import SampledRunConfig
from .toolkit import (
    CheckpointManager,
    ExampleSampler,
    MetricsLogger,
    TrainResult,
    autocast_for,
    data_options,
    effective_warmup,
    load_inputs,
    make_optimizer,
    make_scheduler,
    optimizer_step,
    progress,
    restore_rng,
    rng_state,
    start_run,
)


class SFTConfig(SampledRunConfig):
    filter_correct: bool = False
    max_examples: int | None = Field(None, ge=1)
    # --- optimisation
    n_sft_steps: int = Field(200, ge=1)  # optimizer steps
    learning_rate: float = Field(2e-5, gt=0)
    train_batch_size: int = Field(32, ge=1)
    gradient_accumulation_steps: int = Field(4, ge=1)
    normalize_constant: float = Field(1.0, gt=0)  # sum of response-token NLL / this (CS336)
    warmup_steps: int = Field(1000, ge=0)  # capped at 10 % of n_sft_steps
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    # --- evaluation, logging, checkpoints
    eval_every: int = Field(0, ge=0)
    log_generations_samples: int = Field(8, ge=0)
    checkpoint_every: int = Field(0, ge=0)
    keep_last: int = Field(2, ge=1)
    run_dir: str = "runs/sft"
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    deterministic: bool = False


def sft_pairs(cfg: SFTConfig) -> tuple[list[SFTPair], list, Any, Any]:
    """(training pairs, eval examples, template, reward fn) with filtering and the size cap applied."""
    if cfg.train_data is not None and _looks_like_sft_pairs(cfg.train_data):
        pairs = list(load_sft_pairs(cfg.train_data))
        template = load_template(cfg.prompt_template or "r1_zero")
        reward = build_reward(cfg.reward if cfg.reward is not None else "r1_zero")
        evals = list(load_examples(cfg.eval_data, **data_options(cfg)))[: cfg.eval_examples] if cfg.eval_data else []
    else:
        train, evals, template, reward = load_inputs(cfg)
        missing = [i for i, e in enumerate(train) if not e.solution]
        if missing:
            raise ValueError(f"{cfg.train_data or cfg.task}: example {missing[0]} has no worked solution to imitate")
        pairs = [SFTPair(template.format(e.question), e.solution, e.answer) for e in train]
    if cfg.filter_correct:
        if reward is None:
            raise ValueError("filter_correct needs a reward (verifier)")
        if any(p.ground_truth is None for p in pairs):
            raise ValueError("filter_correct needs a ground truth for every pair ('ground_truth' field)")
        scores = RewardScorer(reward, timeout_s=0).score([p.response for p in pairs], [p.ground_truth for p in pairs])
        pairs = [p for p, s in zip(pairs, scores) if s["reward"] >= 1.0]
        if not pairs:
            raise ValueError("filter_correct kept no example: the verifier rejected every response")
    if cfg.max_examples is not None:
        pairs = pairs[: cfg.max_examples]
    return pairs, evals, template, reward


def _looks_like_sft_pairs(path: str) -> bool:
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(obj, dict) and "prompt" in obj and "response" in obj
    return False


def accumulate_sft_gradient(model, tokenizer, pairs: list[SFTPair], gradient_accumulation_steps: int,
                            normalize_constant: float, device, autocast) -> tuple[float, float, float]:
    """Forward/backward one optimizer batch of (prompt, response) pairs in equal micro-batches, loss
    on the response tokens only. Returns (loss, summed token NLL, response tokens)."""
    micro = len(pairs) // gradient_accumulation_steps
    total_loss, total_nll, total_tok = 0.0, 0.0, 0.0
    for m in range(gradient_accumulation_steps):
        chunk = pairs[m * micro : (m + 1) * micro]
        batch = tokenize_prompt_and_output([p.prompt for p in chunk], [p.response for p in chunk], tokenizer)
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            out = get_response_log_probs(model, batch["input_ids"], batch["labels"])
        loss, meta = sft_microbatch_train_step(out["log_probs"].float(), batch["response_mask"],
                                               gradient_accumulation_steps, normalize_constant)
        n_tok = float(meta["num_response_tokens"])
        total_loss += float(loss)
        total_nll += float(meta["token_nll"]) * n_tok
        total_tok += n_tok
    return total_loss, total_nll, total_tok


def train_sft(cfg: SFTConfig, *, model=None, tokenizer=None, resume: bool = False) -> TrainResult:
    """Run SFT as configured; ``model``/``tokenizer`` override ``cfg.model``."""
    wall = time.perf_counter()
    run, ckpts, resume_from, device, model, tokenizer = start_run(cfg, resume, model, tokenizer)
    autocast = autocast_for(cfg.dtype, device)
    pairs, eval_examples, template, reward_fn = sft_pairs(cfg)

    optimizer = make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, effective_warmup(cfg.warmup_steps, cfg.n_sft_steps), cfg.n_sft_steps, cfg.lr_schedule)
    sampler = ExampleSampler(len(pairs), cfg.seed)
    sample_gen = torch.Generator().manual_seed(cfg.seed)
    backend = make_backend("hf", model, tokenizer, generator=sample_gen)
    eval_sampling = cfg.eval_sampling_params()
    start_step, eval_step = 0, 0
    if resume_from is not None:
        state = CheckpointManager.load_state(resume_from)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["data"])
        restore_rng(state["rng"], {"sampling": sample_gen})
        start_step, eval_step = state["train_step"], state["eval_step"]
    logger = MetricsLogger(run.metrics_path, cfg.report_to, run_name=run.path.name, config=cfg.to_dict())

    def run_eval(step: int) -> dict[str, float]:
        nonlocal eval_step
        if not eval_examples or reward_fn is None:
            return {}
        result = evaluate(backend, eval_examples, template, reward_fn, eval_sampling)
        extra = log_generations(run.path / "samples" / f"eval_step_{step}.jsonl", result, step, model, tokenizer,
                                cfg.log_generations_samples) if cfg.log_generations_samples else {}
        logger.log({"eval_step": eval_step, "sft_step": step, **{f"eval/{k}": v for k, v in {**result.metrics, **extra}.items()}})
        eval_step += 1
        return result.metrics

    if cfg.eval_every and start_step == 0:
        run_eval(0)  # the starting point of the validation curve
    bar = progress(cfg.n_sft_steps, "SFT", cfg.show_progress, initial=start_step)
    for step in range(start_step, cfg.n_sft_steps):
        idx = sampler.next(cfg.train_batch_size)
        total_loss, total_nll, total_tok = accumulate_sft_gradient(
            model, tokenizer, [pairs[i] for i in idx], cfg.gradient_accumulation_steps, cfg.normalize_constant,
            device, autocast)
        grad_norm = optimizer_step(model, optimizer, scheduler, cfg.max_grad_norm)
        logger.log({"train_step": step, "train/loss": total_loss, "train/token_nll": total_nll / max(total_tok, 1.0),
                    "train/grad_norm": grad_norm, "train/lr": scheduler.get_last_lr()[0]})
        bar.set_postfix(nll=f"{total_nll / max(total_tok, 1.0):.3f}")
        bar.update(1)
        done = step + 1
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.n_sft_steps:
            run_eval(done)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
            ckpts.save(done, model, tokenizer, {
                "train_step": done, "eval_step": eval_step, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "data": sampler.state_dict(),
                "rng": rng_state({"sampling": sample_gen}), "config": cfg.to_dict()})
    bar.close()
    after = run_eval(cfg.n_sft_steps)
    save_model_and_tokenizer(model, tokenizer, run.final)
    logger.close()
    return TrainResult(run.path, run.final, run.metrics_path, after, time.perf_counter() - wall, n_examples=len(pairs))
