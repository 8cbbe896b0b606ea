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

from ..core import pad_token_id
from ..eval import token_entropies
from ..rewards import RewardScorer
from ..training import distributed
from ..training.batching import ExampleSampler, accumulate_sft_gradient
from ..training.inputs import load_inputs
from ..training.optimization import make_optimizer
from ..training.resources import check_sampled_inputs
from ..training.run import ListState, Run, TrainResult
from ..training.run_setup import run_backend
from ..training.sampled_run_config import SampledRunConfig
from ..training.validation import validation


class EIConfig(SampledRunConfig):
    """Expert iteration's fields (CS336 A5 Algorithm 2's names), beside the sampling ones."""

    command, steps_field, step_key = "ei", "n_ei_steps", "ei_step"
    samples_with_vllm = True  # samples through the configured backend, synced before each sampling round
    # --- Expert iteration (CS336 Algorithm 2)
    n_ei_steps: int = Field(5, ge=1)
    """Outer steps (CS336's n_ei_steps): each samples, filters and trains."""
    ei_batch_size: int = Field(512, ge=1)
    """Questions sampled per step (CS336 sweeps 512, 1024, 2048)."""
    group_size: int = Field(4, ge=1)
    """Responses sampled per question (G)."""
    sft_epochs: int = Field(1, ge=1)
    """Epochs of SFT on each step's verified-correct responses (E)."""
    learning_rate: float = Field(2e-5, gt=0)
    """AdamW's learning rate (constant)."""
    train_batch_size: int = Field(32, ge=1)
    """Responses per SFT optimizer step."""
    gradient_accumulation_steps: int = Field(4, ge=1)
    """Micro-batches per SFT optimizer step: raise it to fit memory."""
    normalize_constant: float = Field(1.0, gt=0)
    """The SFT loss is the sum of the response tokens' NLL divided by this (CS336's normalize_constant)."""
    run_dir: str = "runs/ei"


def sft_on_kept(
    run: Run, optimizer, kept: list[tuple[list[int], list[int]]], cfg: EIConfig, step: int, pad_id: int
) -> list[float]:
    """``sft_epochs`` of SFT on the kept responses — their exact sampled ids, end token included,
    so the model also learns where to stop. Returns each batch's token NLL. ``kept`` is the same on
    every rank (gathered); each rank trains on its share of every batch."""
    order = ExampleSampler(len(kept), cfg.seed + step)
    n_batches = max(1, cfg.sft_epochs * len(kept) // cfg.train_batch_size)
    unit = cfg.gradient_accumulation_steps * distributed.current().world_size  # equal micro-batches on every rank
    size = min(cfg.train_batch_size, len(kept)) // unit * unit
    losses = []
    for _ in range(n_batches):
        loss, nll, tok = accumulate_sft_gradient(run.model, distributed.shard([kept[i] for i in order.next(size)]),
                                                 cfg.gradient_accumulation_steps, cfg.normalize_constant, pad_id,
                                                 run.device, run.autocast)
        result = run.optimizer_step(optimizer, None, loss)
        run.log_update({"train_step": run.train_step, "ei_step": step, "train/loss": loss,
                        "train/token_nll": nll / max(tok, 1.0)}, result)
        losses.append(nll / max(tok, 1.0))
        run.train_step += 1
    return losses


def sync(run: Run, backend) -> float:
    """Give a backend with its own weights (a vLLM engine or server) the current ones; its seconds."""
    if not run.weights.engine_holds_weights:
        return 0.0
    t0 = time.perf_counter()
    run.weights.sync(backend)
    return time.perf_counter() - t0


def train_expert_iteration(cfg: EIConfig, *, model=None, tokenizer=None, resume: bool = False,
                           overwrite: bool = False) -> TrainResult:
    inputs = load_inputs(cfg, tokenizer)
    with Run(cfg, resume=resume, overwrite=overwrite, model=model, tokenizer=tokenizer,
             check_inputs=check_sampled_inputs(inputs, cfg)) as run:
        model, tokenizer = run.model, run.tokenizer
        scorer = RewardScorer(inputs.reward, timeout_s=cfg.reward_timeout_s, num_workers=cfg.reward_workers)
        optimizer = run.track("optimizer", make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay))
        questions = run.track("data", ExampleSampler(len(inputs.train), cfg.seed))
        generator = run.track_rng("sampling", torch.Generator().manual_seed(cfg.seed))
        backend = run_backend(run, generator)  # hf, or a vLLM engine / server (CS336 samples with vLLM)
        run.on_close(backend.close)
        sampling, pad_id = cfg.sampling_params(), pad_token_id(tokenizer)
        sizes = run.track("filtered_sizes", ListState()).items
        trained = False  # since the engine (if any) last got the weights
        for step in run.steps():
            sync_s = sync(run, backend) if trained else 0.0
            # every rank draws the same questions and samples its share; the kept responses are gathered
            batch = distributed.shard(
                [inputs.train[i] for i in questions.next(min(cfg.ei_batch_size, len(inputs.train)))]
            )
            rollouts = backend.generate([inputs.template.format(e.question) for e in batch], cfg.group_size, sampling)
            scores = scorer.score([r.scored_response for r in rollouts],
                                  [batch[r.prompt_index].answer for r in rollouts], rollouts=rollouts)
            kept = [(r.prompt_ids, r.response_ids) for r, s in zip(rollouts, scores) if s["reward"] >= 1.0]
            kept = [pair for part in distributed.all_gather_objects(kept) for pair in part]
            entropy = token_entropies(run.sampling_model, rollouts[: min(len(rollouts), 256)], tokenizer,
                                      temperature=cfg.sampling_temperature)
            sizes.append(len(kept))
            record = {"ei_step": step, "ei/filtered_size": len(kept),
                      "ei/sampled": distributed.all_reduce(len(rollouts)),
                      "ei/reward": sum(s["reward"] for s in scores) / len(scores),
                      "ei/response_entropy": sum(entropy) / max(1, len(entropy)),
                      "ei/response_length": sum(len(r.response_ids) for r in rollouts) / len(rollouts)}
            if run.weights.engine_holds_weights:
                record["time/weight_sync_s"] = sync_s
            if len(kept) >= cfg.gradient_accumulation_steps * distributed.current().world_size:
                losses = sft_on_kept(run, optimizer, kept, cfg, step, pad_id)
                record["ei/sft_token_nll"] = sum(losses) / len(losses)
                trained = True
            else:  # too few to fill one micro-batch per rank: this step's SFT is skipped, said and counted
                record.update({"train/skipped_updates": 1, "train/skipped_updates_too_few_kept": 1})
                run.bar.write(f"grpolab health: ei step {step}: {len(kept)} correct response(s) kept, fewer than the "
                              f"{cfg.gradient_accumulation_steps * distributed.current().world_size} one SFT step "
                              "needs (gradient_accumulation_steps x ranks): this step's SFT skipped")
            run.log(record)
            run.bar.set_postfix(kept=len(kept), reward=f"{record['ei/reward']:.3f}")
            run.end_step(step + 1)
        if trained:
            sync(run, backend)
        after = validation(run, backend, inputs, cfg, scorer)(cfg.n_ei_steps)
        scorer.close()
        return run.finish(after, filtered_sizes=sizes)
