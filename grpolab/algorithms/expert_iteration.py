"""Expert iteration (CS336 A5 Algorithm 2; Anthony et al. 2017, STaR by Zelikman et al. 2022).

For each of ``n_ei_steps``: take a batch of ``ei_batch_size`` questions, sample ``group_size``
responses each from the current policy, keep the responses the verifier accepts, and run SFT on
them for ``sft_epochs`` epochs. Logged per step: the size of the filtered set, the policy's mean
token entropy on its samples, the reward of the samples, and the SFT loss.
"""

from __future__ import annotations

import time

import torch
from pydantic import Field

from ..data.datasets import SFTPair
from ..eval import evaluate, token_entropies
from ..models import save_model_and_tokenizer
from ..rewards import RewardScorer
from ..rollout import make_backend
from .config import SampledRunConfig
from .sft import accumulate_sft_gradient
from .toolkit import (
    ExampleSampler,
    MetricsLogger,
    TrainResult,
    autocast_for,
    load_inputs,
    make_optimizer,
    optimizer_step,
    progress,
    start_run,
)


class EIConfig(SampledRunConfig):
    n_ei_steps: int = Field(5, ge=1)  # CS336 Algorithm 2's n_ei_steps
    ei_batch_size: int = Field(512, ge=1)  # questions per step (CS336 sweeps 512, 1024, 2048)
    group_size: int = Field(4, ge=1)  # responses sampled per question (G)
    sft_epochs: int = Field(1, ge=1)  # epochs of SFT on each filtered set (E)
    learning_rate: float = Field(2e-5, gt=0)
    train_batch_size: int = Field(32, ge=1)
    gradient_accumulation_steps: int = Field(4, ge=1)
    normalize_constant: float = Field(1.0, gt=0)
    run_dir: str = "runs/ei"


def train_expert_iteration(cfg: EIConfig, *, model=None, tokenizer=None) -> TrainResult:
    wall = time.perf_counter()
    run, _, _, device, model, tokenizer = start_run(cfg, model=model, tokenizer=tokenizer)
    autocast = autocast_for(cfg.dtype, device)
    train, evals, template, reward_fn = load_inputs(cfg)
    scorer = RewardScorer(reward_fn, timeout_s=0)
    optimizer = make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay)
    backend = make_backend("hf", model, tokenizer, generator=torch.Generator().manual_seed(cfg.seed),
                           autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None)
    sampling = cfg.sampling_params()
    questions = ExampleSampler(len(train), cfg.seed)
    logger = MetricsLogger(run.metrics_path)
    sizes: list[int] = []
    train_step = 0
    bar = progress(cfg.n_ei_steps, "EI", cfg.show_progress)
    for step in range(cfg.n_ei_steps):
        batch = [train[i] for i in questions.next(min(cfg.ei_batch_size, len(train)))]
        rollouts = backend.generate([template.format(e.question) for e in batch], cfg.group_size, sampling)
        scores = scorer.score([r.response for r in rollouts], [batch[r.prompt_index].answer for r in rollouts])
        kept = [SFTPair(r.prompt, r.response, batch[r.prompt_index].answer) for r, s in zip(rollouts, scores) if s["reward"] >= 1.0]
        entropy = token_entropies(model, rollouts[: min(len(rollouts), 256)], tokenizer)
        sizes.append(len(kept))
        record = {"ei_step": step, "ei/filtered_size": len(kept), "ei/sampled": len(rollouts),
                  "ei/reward": sum(s["reward"] for s in scores) / len(scores),
                  "ei/response_entropy": sum(entropy) / max(1, len(entropy)),
                  "ei/response_length": sum(len(r.response_ids) for r in rollouts) / len(rollouts)}
        if len(kept) >= cfg.gradient_accumulation_steps:
            order = ExampleSampler(len(kept), cfg.seed + step)
            n_batches = max(1, cfg.sft_epochs * len(kept) // cfg.train_batch_size)
            size = min(cfg.train_batch_size, len(kept)) // cfg.gradient_accumulation_steps * cfg.gradient_accumulation_steps
            losses = []
            for _ in range(n_batches):
                loss, nll, tok = accumulate_sft_gradient(model, tokenizer, [kept[i] for i in order.next(size)],
                                                         cfg.gradient_accumulation_steps, cfg.normalize_constant,
                                                         device, autocast)
                optimizer_step(model, optimizer, None, cfg.max_grad_norm)
                logger.log({"train_step": train_step, "ei_step": step, "train/loss": loss,
                            "train/token_nll": nll / max(tok, 1.0)})
                losses.append(nll / max(tok, 1.0))
                train_step += 1
            record["ei/sft_token_nll"] = sum(losses) / len(losses)
        logger.log(record)
        bar.set_postfix(kept=len(kept), reward=f"{record['ei/reward']:.3f}")
        bar.update(1)
    bar.close()
    after = evaluate(backend, evals, template, reward_fn, cfg.eval_sampling_params()).metrics if evals else {}
    if after:
        logger.log({"eval_step": 0, **{f"eval/{k}": v for k, v in after.items()}})
    save_model_and_tokenizer(model, tokenizer, run.final)
    logger.close()
    return TrainResult(run.path, run.final, run.metrics_path, after, time.perf_counter() - wall, filtered_sizes=sizes)
