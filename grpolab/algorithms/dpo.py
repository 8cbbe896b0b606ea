"""DPO: Direct Preference Optimization (Rafailov et al. 2023; CS336 A5 supplement).

``compute_per_instance_dpo_loss`` has the CS336 supplement's signature and semantics: both
sequences are the Alpaca-formatted prompt with the response and an end-of-sequence token; the
loss is ``-log sigmoid(beta * ((log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))))``
over the response tokens. ``train_dpo`` (``grpolab dpo``) trains on a preference JSONL
(``{prompt, chosen, rejected}``) or on pairs built from an embedded task (a correct worked solution
preferred to a wrong one), and reports preference accuracy on held-out pairs.
"""

from __future__ import annotations

import copy
import random
import time
from typing import Literal

import torch
from pydantic import Field

from ..core import compute_dpo_loss, sum_response_log_probs
from ..data import PreferencePair, get_task, load_preferences, load_template
from ..models import save_model_and_tokenizer
from .config import RunConfig
from .toolkit import (
    ExampleSampler,
    MetricsLogger,
    TrainResult,
    effective_warmup,
    make_optimizer,
    make_scheduler,
    optimizer_step,
    progress,
    start_run,
)

ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def compute_per_instance_dpo_loss(lm, lm_ref, tokenizer, beta: float, prompt: str, response_chosen: str,
                                  response_rejected: str) -> torch.Tensor:
    """Per-instance DPO loss (CS336 A5 supplement): Alpaca-formatted prompt, response + EOS."""
    prompt_text = ALPACA_TEMPLATE.format(instruction=prompt)
    eos = tokenizer.eos_token or ""
    prompts, responses = [prompt_text] * 2, [response_chosen + eos, response_rejected + eos]
    (lp_c, lp_r), _ = sum_response_log_probs(lm, tokenizer, prompts, responses)
    with torch.no_grad():
        (ref_c, ref_r), _ = sum_response_log_probs(lm_ref, tokenizer, prompts, responses)
    return compute_dpo_loss(lp_c, lp_r, ref_c.to(lp_c.device), ref_r.to(lp_c.device), beta)


class DPOConfig(RunConfig):
    task_train_size: int = Field(1000, ge=1)
    use_alpaca_template: bool = False  # wrap prompts in the Alpaca template (CS336 supplement)
    beta: float = Field(0.1, gt=0)
    n_dpo_steps: int = Field(100, ge=1)
    learning_rate: float = Field(1e-6, gt=0)
    train_batch_size: int = Field(16, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    eval_every: int = Field(0, ge=0)
    eval_pairs: int = Field(200, ge=1)
    run_dir: str = "runs/dpo"


def task_preference_pairs(task_name: str, split: str, n: int, seed: int, options: dict, template) -> list[PreferencePair]:
    """(prompt, a correct worked solution, the same solution with a wrong final answer) for ``n``
    questions of an embedded task's split."""
    task = get_task(task_name, seed=seed, **{**options, "wrong_fraction": 0.0})
    rng = random.Random(f"pairs:{seed}:{split}")
    return [PreferencePair(template.format(e.question), e.solution, task.wrong_solution(e, rng))
            for e in task.examples(split, n)]


def _pairs(cfg: DPOConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
    if cfg.task is not None:
        task = get_task(cfg.task, seed=cfg.seed, **cfg.task_options)
        template = load_template(cfg.prompt_template or task.default_template)
        train = task_preference_pairs(cfg.task, "train", cfg.task_train_size, cfg.seed, cfg.task_options, template)
        held = task_preference_pairs(cfg.task, "validation", cfg.eval_pairs, cfg.seed, cfg.task_options, template)
        return train, held
    pairs = list(load_preferences(cfg.train_data))
    if cfg.eval_data:
        return pairs, list(load_preferences(cfg.eval_data))[: cfg.eval_pairs]
    rng = random.Random(cfg.seed)
    rng.shuffle(pairs)
    n_held = max(1, len(pairs) // 10)
    return pairs[n_held:], pairs[:n_held][: cfg.eval_pairs]


def _batch_logps(lm, tokenizer, pairs: list[PreferencePair], alpaca: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) response log-prob sums of a batch of pairs, in one forward."""
    fmt = (lambda p: ALPACA_TEMPLATE.format(instruction=p)) if alpaca else (lambda p: p)
    eos = tokenizer.eos_token or ""
    prompts = [fmt(p.prompt) for p in pairs] * 2
    responses = [p.chosen + eos for p in pairs] + [p.rejected + eos for p in pairs]
    sums, _ = sum_response_log_probs(lm, tokenizer, prompts, responses)
    return sums[: len(pairs)], sums[len(pairs):]


@torch.no_grad()
def preference_accuracy(lm, lm_ref, tokenizer, pairs, beta, alpaca, device, batch_size: int = 32) -> dict[str, float]:
    """Held-out preference accuracy: the share of pairs whose implicit reward margin
    ``beta * ((c - c_ref) - (r - r_ref))`` is positive; also the mean DPO loss and margin."""
    if not pairs:
        raise ValueError("no held-out preference pairs to evaluate on")
    correct, losses, margins = 0, [], []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        c, r = _batch_logps(lm, tokenizer, chunk, alpaca, device)
        rc, rr = _batch_logps(lm_ref, tokenizer, chunk, alpaca, device)
        margin = beta * ((c - rc) - (r - rr))
        correct += int((margin > 0).sum())
        losses.append(compute_dpo_loss(c, r, rc, rr, beta))
        margins.append(margin)
    return {"preference_accuracy": correct / max(1, len(pairs)), "dpo_loss": float(torch.cat(losses).mean()),
            "reward_margin": float(torch.cat(margins).mean())}


def train_dpo(cfg: DPOConfig, *, model=None, tokenizer=None, ref_model=None) -> TrainResult:
    wall = time.perf_counter()
    run, _, _, device, model, tokenizer = start_run(cfg, model=model, tokenizer=tokenizer)
    ref = (ref_model or copy.deepcopy(model)).to(device).eval().requires_grad_(False)
    train, held = _pairs(cfg)
    if not train:
        raise ValueError("no training pairs")
    logger = MetricsLogger(run.metrics_path)
    optimizer = make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, effective_warmup(cfg.warmup_steps, cfg.n_dpo_steps), cfg.n_dpo_steps, cfg.lr_schedule)
    sampler = ExampleSampler(len(train), cfg.seed)

    def held_out(step: int) -> dict[str, float]:
        model.eval()
        m = preference_accuracy(model, ref, tokenizer, held, cfg.beta, cfg.use_alpaca_template, device)
        model.train()
        logger.log({"eval_step": step, **{f"eval/{k}": v for k, v in m.items()}})
        return m

    before = held_out(0)
    micro = cfg.train_batch_size // cfg.gradient_accumulation_steps
    bar = progress(cfg.n_dpo_steps, "DPO", cfg.show_progress)
    for step in range(cfg.n_dpo_steps):
        idx = sampler.next(cfg.train_batch_size)
        total, acc = 0.0, 0
        for m in range(cfg.gradient_accumulation_steps):
            chunk = [train[i] for i in idx[m * micro : (m + 1) * micro]]
            c, r = _batch_logps(model, tokenizer, chunk, cfg.use_alpaca_template, device)
            with torch.no_grad():
                rc, rr = _batch_logps(ref, tokenizer, chunk, cfg.use_alpaca_template, device)
            losses = compute_dpo_loss(c, r, rc, rr, cfg.beta)
            (losses.mean() / cfg.gradient_accumulation_steps).backward()
            total += float(losses.detach().mean()) / cfg.gradient_accumulation_steps
            acc += int(((c - rc) - (r - rr) > 0).sum())
        grad_norm = optimizer_step(model, optimizer, scheduler, cfg.max_grad_norm)
        logger.log({"train_step": step, "train/dpo_loss": total, "train/preference_accuracy": acc / cfg.train_batch_size,
                    "train/grad_norm": grad_norm, "train/lr": scheduler.get_last_lr()[0]})
        bar.set_postfix(loss=f"{total:.4f}")
        bar.update(1)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.n_dpo_steps:
            held_out(step + 1)
    bar.close()
    after = held_out(cfg.n_dpo_steps)
    save_model_and_tokenizer(model, tokenizer, run.final)
    logger.close()
    return TrainResult(run.path, run.final, run.metrics_path, after, time.perf_counter() - wall, before=before)
