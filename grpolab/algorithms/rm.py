"""Reward-model training (``grpolab rm``): Bradley–Terry on preference pairs (Ouyang et al. 2022,
§3.5; TRL's RewardTrainer), with the optional margin of Llama 2.

The data are DPO's: a preference JSONL (``{prompt, chosen, rejected}``) or pairs built from an
embedded task (a correct worked solution preferred to the same solution with a wrong final answer);
``load_preference_inputs`` reads both. The model is a sequence classifier with one output: a
``*ForSequenceClassification`` directory as it is, or any causal LM (a directory, ``embedded:tiny``)
with a value head on its last non-pad token (``models.classifier``). Each pair is two texts —
``prompt + chosen`` and ``prompt + rejected``, exactly what ``reward: {model: ...}`` scores later
(``rewards.reward_model_text``) — and the loss is ``-log sigmoid(r_c - r_r - margin)``.

Everything else is the shared ``Run``: checkpoints and exact resume, metrics (``train/loss``,
``train/accuracy``, ``eval/pairwise_accuracy``, ``eval/reward_margin``), and ``final/``, an ordinary
Hugging Face directory that ``AutoModelForSequenceClassification.from_pretrained`` loads.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..core import compute_bradley_terry_loss, pad_token_id
from ..data import PreferencePair
from ..models.classifier import load_sequence_classifier
from ..rewards import reward_model_text
from ..training import distributed
from ..training.batching import ExampleSampler
from ..training.inputs import fitting_indices, load_preference_inputs
from ..training.optimization import effective_warmup, make_optimizer, make_scheduler
from ..training.resources import context_length
from ..training.run import Run, TrainResult
from ..training.run_config import RunConfig


class RMConfig(RunConfig):
    """Reward-model training's fields (Bradley-Terry on preference pairs; Ouyang et al. 2022)."""

    command, steps_field, step_key = "rm", "n_rm_steps", "rm_step"
    task_train_size: int = Field(1000, ge=1)
    # --- Reward model (Bradley-Terry)
    n_rm_steps: int = Field(100, ge=1)
    """Optimizer steps (the run's length)."""
    learning_rate: float = Field(1e-5, gt=0)
    """AdamW's peak learning rate."""
    train_batch_size: int = Field(16, ge=1)
    """Preference pairs per optimizer step."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step: raise it to fit memory."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up in optimizer steps, capped at 10 % of n_rm_steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: a constant learning rate, or cosine decay to 0 at the last step."""
    margin: float = Field(0.0, ge=0)
    """Llama 2's margin: the loss is -log sigmoid(r_chosen - r_rejected - margin) (0: plain Bradley-Terry)."""
    max_length: int = Field(1024, ge=1)
    """Tokens per text, truncated from the left (the score is read at the last token)."""
    chat_template: bool = False
    """Render (prompt, response) with the model's chat template, as reward: {model: ..., chat_template: true} will."""
    eval_pairs: int = Field(200, ge=1)
    """The most held-out pairs the pairwise accuracy is measured on."""
    run_dir: str = "runs/rm"


def _load(path: str, seed: int = 0, trust_remote_code: bool = False, gradient_checkpointing: bool = False):
    """Run's model loader for reward models (gradient checkpointing is switched on by the Run)."""
    return load_sequence_classifier(path, seed=seed, trust_remote_code=trust_remote_code)


def pair_token_ids(tokenizer, pairs: list[PreferencePair], cfg: RMConfig) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) of each pair, untruncated: the texts ``reward: {model: ...}``
    scores (``rewards.reward_model_text``, with a task pair's raw question as the user message
    under ``chat_template``, as scoring passes it)."""
    if not pairs:
        return []
    tokenizer.truncation_side = "left"  # saved with final/: a plain tokenizer(...) call truncates as training did

    def ids(field: str) -> list[list[int]]:
        texts = [reward_model_text(tokenizer, p.prompt, getattr(p, field), p.question, cfg.chat_template)
                 for p in pairs]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return list(zip(ids("chosen"), ids("rejected")))


def _padded(rows: list[list[int]], tokenizer, device) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of ``rows`` padded on the tokenizer's padding side."""
    width, pad, left = max(map(len, rows)), pad_token_id(tokenizer), tokenizer.padding_side == "left"
    ids = [[pad] * (width - len(r)) + r if left else r + [pad] * (width - len(r)) for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) if left else [1] * len(r) + [0] * (width - len(r)) for r in rows]
    return {"input_ids": torch.tensor(ids, device=device), "attention_mask": torch.tensor(mask, device=device)}


def pair_rewards(model, tokenizer, pairs: list, cfg: RMConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores of a batch of pairs, in one forward over both texts of every pair;
    each text truncated from the left to ``max_length`` tokens. ``pairs``: ``PreferencePair``s, or
    their ``pair_token_ids`` (what ``train_rm`` tokenised before the run)."""
    if pairs and isinstance(pairs[0], PreferencePair):
        pairs = pair_token_ids(tokenizer, pairs, cfg)
    rows = [list(c[-cfg.max_length:]) for c, _ in pairs] + [list(r[-cfg.max_length:]) for _, r in pairs]
    scores = model(**_padded(rows, tokenizer, device)).logits[:, 0].float()
    return scores[: len(pairs)], scores[len(pairs):]


def rm_check(train: list[PreferencePair], held: list[PreferencePair], cfg: RMConfig):
    """(``check_inputs`` for the Run, ``checked``): before the run directory is touched, both texts
    of every pair are rendered and tokenised, and the longer one, truncated to ``max_length``, fits
    the model's context (else one line naming its file:line, or skipped with ``data_on_error:
    skip``); ``checked`` then holds the ``pair_token_ids`` kept, ``train`` and ``held``."""
    checked = {}

    def check(model, tokenizer, device) -> None:
        limit = context_length(model)
        for name, pairs in (("train", train), ("held", held)):
            ids = pair_token_ids(tokenizer, pairs, cfg)
            sizes = [(min(max(len(c), len(r)), cfg.max_length),
                      f"chosen {len(c)}, rejected {len(r)}, truncated to max_length {cfg.max_length}") for c, r in ids]
            kept = fitting_indices(sizes, [pair.source for pair in pairs], limit, cfg.data_on_error, "preference pair")
            checked[name] = [ids[i] for i in kept]

    return check, checked


@torch.no_grad()
def pairwise_accuracy(model, tokenizer, pairs: list[PreferencePair], cfg: RMConfig, device,
                      batch_size: int = 32) -> dict[str, float]:
    """Held-out figures: the share of pairs whose chosen response scores above the rejected one,
    the mean margin ``r_c - r_r`` and the mean loss."""
    if not pairs:
        raise ValueError("no held-out preference pairs to evaluate on")
    margins = []
    for i in range(0, len(pairs), batch_size):
        c, r = pair_rewards(model, tokenizer, pairs[i : i + batch_size], cfg, device)
        margins.append(c - r)
    m = torch.cat(margins)
    return {"pairwise_accuracy": float((m > 0).float().mean()), "reward_margin": float(m.mean()),
            "loss": float(compute_bradley_terry_loss(m, torch.zeros_like(m), cfg.margin).mean())}


def rm_gradient(model, tokenizer, pairs: list[PreferencePair], cfg: RMConfig, device) -> tuple[float, int, float]:
    """Forward/backward one optimizer batch in micro-batches: the mean loss, the number of pairs
    ranked right and the summed margin (over every rank in a distributed run)."""
    micro = max(1, len(pairs) // cfg.gradient_accumulation_steps)
    total, correct, margin = 0.0, 0, 0.0
    for m in range(cfg.gradient_accumulation_steps):
        chunk = pairs[m * micro : (m + 1) * micro]
        c, r = pair_rewards(model, tokenizer, chunk, cfg, device)
        losses = compute_bradley_terry_loss(c, r, cfg.margin)
        (losses.mean() / cfg.gradient_accumulation_steps).backward()
        total += float(losses.detach().mean()) / cfg.gradient_accumulation_steps
        correct += int((c > r).sum())
        margin += float((c - r).detach().sum())
    for _ in range(distributed.padding_micro_batches(cfg.gradient_accumulation_steps)):
        distributed.dummy_backward(model)
    world = distributed.current().world_size
    return distributed.all_reduce(total) / world, distributed.all_reduce(correct), distributed.all_reduce(margin)


def train_rm(
    cfg: RMConfig, *, model=None, tokenizer=None, resume: bool = False, overwrite: bool = False
) -> TrainResult:
    """Train a reward model as configured (``model``/``tokenizer``: a sequence classifier to start from)."""
    train, held = load_preference_inputs(cfg, tokenizer)
    if not train:
        raise ValueError("no training pairs")
    check, checked = rm_check(train, held, cfg)
    with Run(cfg, resume=resume, overwrite=overwrite, model=model, tokenizer=tokenizer, load_model=_load,
             check_inputs=check) as run:
        model, tokenizer = run.model, run.tokenizer
        train, held = checked["train"], checked["held"]  # tokenised by the check
        optimizer = run.track("optimizer", make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay))
        scheduler = run.track("scheduler", make_scheduler(
            optimizer, effective_warmup(cfg.warmup_steps, cfg.n_rm_steps), cfg.n_rm_steps, cfg.lr_schedule))
        sampler = run.track("data", ExampleSampler(len(train), cfg.seed))

        def held_out(step: int) -> dict[str, float]:
            model.eval()
            try:
                return run.validate(step,
                                    lambda: pairwise_accuracy(run.sampling_model, tokenizer, held, cfg, run.device))
            finally:
                model.train()

        before = held_out(0) if not run.resuming else None
        for step in run.steps():
            batch = distributed.shard([train[i] for i in sampler.next(cfg.train_batch_size)])
            loss, correct, margin = rm_gradient(run.model, tokenizer, batch, cfg, run.device)
            result = run.optimizer_step(optimizer, scheduler, loss)
            run.log_update({"train_step": step, "rm_step": step, "train/loss": loss,
                            "train/accuracy": correct / cfg.train_batch_size,
                            "train/reward_margin": margin / cfg.train_batch_size}, result, optimizer)
            run.train_step = step + 1
            run.bar.set_postfix(loss=f"{loss:.4f}")
            run.end_step(step + 1, held_out)
        after = held_out(cfg.n_rm_steps)
        return run.finish(after, before=before)
