"""DPO: Direct Preference Optimization (Rafailov et al. 2023; CS336 A5 supplement).

``compute_per_instance_dpo_loss`` has the CS336 supplement's signature and semantics: both
sequences are the Alpaca-formatted prompt with the response and an end-of-sequence token; the
loss is ``-log sigmoid(beta * ((log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))))``
over the response tokens. ``train_dpo`` (``grpolab dpo``) trains on a preference JSONL
(``{prompt, chosen, rejected}``) or on pairs built from an embedded task (a correct worked solution
preferred to a wrong one), and reports preference accuracy on held-out pairs.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..core import build_sequences, compute_dpo_loss, pad_token_id
from ..data import PreferencePair, TemplateError, is_conversation, render_chat
from ..models import response_log_probs, sum_response_log_probs
from ..training import distributed
from ..training.batching import ExampleSampler
from ..training.inputs import fitting_indices, load_preference_inputs
from ..training.optimization import effective_warmup, make_optimizer, make_scheduler
from ..training.resources import context_length
from ..training.run import Run, TrainResult
from ..training.run_config import RunConfig
from ..training.run_model import frozen_copy

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
    """DPO's fields (Rafailov et al. 2023; CS336 A5 supplement)."""

    command, steps_field, step_key = "dpo", "n_dpo_steps", "dpo_step"
    needs_reference, rows_per_example = True, 2  # the loss reads a frozen reference; a pair: chosen and rejected
    task_train_size: int = Field(1000, ge=1)
    # --- DPO
    use_alpaca_template: bool = False
    """Wrap prompts in the Alpaca template, as the CS336 supplement does."""
    beta: float = Field(0.1, gt=0)
    """DPO's beta: the strength of the implicit KL to the reference (the starting model)."""
    n_dpo_steps: int = Field(100, ge=1)
    """Optimizer steps (the run's length)."""
    learning_rate: float = Field(1e-6, gt=0)
    """AdamW's peak learning rate."""
    train_batch_size: int = Field(16, ge=1)
    """Preference pairs per optimizer step."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step: raise it to fit memory."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up in optimizer steps, capped at 10 % of n_dpo_steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: a constant learning rate, or cosine decay to 0 at the last step."""
    eval_pairs: int = Field(200, ge=1)
    """The most held-out pairs the preference accuracy is measured on."""
    run_dir: str = "runs/dpo"


def _prompt_text(tokenizer, pair: PreferencePair, alpaca: bool) -> str:
    """A conversation rendered by the chat template (an error names the pair's file:line); text as
    given, or in Alpaca's template."""
    if is_conversation(pair.prompt):
        try:
            return render_chat(tokenizer, pair.prompt, add_generation_prompt=True)
        except TemplateError as exc:
            raise TemplateError(f"{pair.source}: {exc}" if pair.source else str(exc)) from None
    return ALPACA_TEMPLATE.format(instruction=pair.prompt) if alpaca else pair.prompt


def pair_token_ids(tokenizer, pairs: list[PreferencePair], alpaca: bool
                   ) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, chosen ids, rejected ids) of each pair: the prompt rendered (``_prompt_text``),
    each response with the eos text, tokenised separately (as ``sum_response_log_probs`` does)."""
    if not pairs:
        return []
    eos = tokenizer.eos_token or ""

    def ids(texts):
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    prompts = ids([_prompt_text(tokenizer, p, alpaca) for p in pairs])
    return list(zip(prompts, ids([p.chosen + eos for p in pairs]), ids([p.rejected + eos for p in pairs])))


def _batch_logps(lm, tokenizer, pairs: list, alpaca: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) response log-prob sums of a batch of pairs, in one forward. ``pairs``:
    ``PreferencePair``s, or their ``pair_token_ids`` (what ``train_dpo`` tokenised before the run)."""
    if pairs and isinstance(pairs[0], PreferencePair):
        pairs = pair_token_ids(tokenizer, pairs, alpaca)
    prompts = [p for p, _, _ in pairs] * 2
    responses = [c for _, c, _ in pairs] + [r for _, _, r in pairs]
    batch = build_sequences(prompts, responses, pad_token_id(tokenizer))
    device = next(lm.parameters()).device
    mask = batch["response_mask"].to(device)
    lp = response_log_probs(lm, batch["input_ids"].to(device), batch["labels"].to(device))["log_probs"]
    sums = (lp * mask).sum(-1)
    return sums[: len(pairs)], sums[len(pairs):]


def dpo_check(train: list[PreferencePair], held: list[PreferencePair], cfg: DPOConfig):
    """(``check_inputs`` for the Run, ``checked``): before the run directory is touched, every pair
    is rendered and tokenised, and prompt + the longer response fits the model's context (else
    one line naming its file:line, or skipped with ``data_on_error: skip``); ``checked`` then holds
    the ``pair_token_ids`` of the pairs kept, ``train`` and ``held``, tokenised once."""
    checked = {}

    def check(model, tokenizer, device) -> None:
        if tokenizer.eos_token is None:  # a response must end: the model learns to stop where the pair does
            raise ValueError("DPO ends each response with the tokenizer's eos token, and this tokenizer has none "
                             "(set eos_token in its tokenizer_config.json)")
        limit = context_length(model)
        for name, pairs in (("train", train), ("held", held)):
            ids = pair_token_ids(tokenizer, pairs, cfg.use_alpaca_template)
            sizes = [(len(p) + max(len(c), len(r)), f"prompt {len(p)} + the longer response {max(len(c), len(r))}")
                     for p, c, r in ids]
            kept = fitting_indices(sizes, [pair.source for pair in pairs], limit, cfg.data_on_error,
                                   "preference pair")
            checked[name] = [ids[i] for i in kept]

    return check, checked


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


def dpo_gradient(model, ref, tokenizer, pairs: list[PreferencePair], cfg: DPOConfig, device) -> tuple[float, int]:
    """Forward/backward one optimizer batch of preference pairs in micro-batches; returns the mean
    DPO loss and the number of pairs whose implicit reward margin is positive. In a distributed run
    ``pairs`` is this rank's equal share (the engine averages the per-rank means); the figures are
    over all ranks."""
    micro = len(pairs) // cfg.gradient_accumulation_steps
    total, acc = 0.0, 0
    padding = distributed.padding_micro_batches(cfg.gradient_accumulation_steps)
    for m in range(cfg.gradient_accumulation_steps):
        chunk = pairs[m * micro : (m + 1) * micro]
        c, r = _batch_logps(model, tokenizer, chunk, cfg.use_alpaca_template, device)
        with torch.no_grad():
            rc, rr = _batch_logps(ref, tokenizer, chunk, cfg.use_alpaca_template, device)
        losses = compute_dpo_loss(c, r, rc, rr, cfg.beta)
        (losses.mean() / cfg.gradient_accumulation_steps).backward()
        total += float(losses.detach().mean()) / cfg.gradient_accumulation_steps
        acc += int(((c - rc) - (r - rr) > 0).sum())
    for _ in range(padding):
        distributed.dummy_backward(model)
    return distributed.all_reduce(total) / distributed.current().world_size, distributed.all_reduce(acc)


def train_dpo(cfg: DPOConfig, *, model=None, tokenizer=None, ref_model=None, resume: bool = False,
              overwrite: bool = False) -> TrainResult:
    train, held = load_preference_inputs(cfg, tokenizer, render_prompts=True)
    if not train:
        raise ValueError("no training pairs")
    check, checked = dpo_check(train, held, cfg)
    with Run(cfg, resume=resume, overwrite=overwrite, model=model, tokenizer=tokenizer, check_inputs=check) as run:
        model, tokenizer = run.model, run.tokenizer
        train, held = checked["train"], checked["held"]  # tokenised by the check
        ref = run.track("reference_model",
                        (frozen_copy(ref_model) if ref_model is not None else frozen_copy(model)).to(run.device))
        optimizer = run.track("optimizer", make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay))
        scheduler = run.track("scheduler", make_scheduler(
            optimizer, effective_warmup(cfg.warmup_steps, cfg.n_dpo_steps), cfg.n_dpo_steps, cfg.lr_schedule))
        sampler = run.track("data", ExampleSampler(len(train), cfg.seed))

        def held_out(step: int) -> dict[str, float]:
            model.eval()
            try:
                return run.validate(
                    step,
                    lambda: preference_accuracy(run.sampling_model, ref, tokenizer, held, cfg.beta,
                                                cfg.use_alpaca_template, run.device),
                )
            finally:
                model.train()

        before = held_out(0) if not run.resuming else None
        for step in run.steps():
            total, acc = dpo_gradient(run.model, ref, tokenizer,
                                      distributed.shard([train[i] for i in sampler.next(cfg.train_batch_size)]), cfg,
                                      run.device)
            result = run.optimizer_step(optimizer, scheduler, total)
            run.log_update({"train_step": step, "train/dpo_loss": total,
                            "train/preference_accuracy": acc / cfg.train_batch_size}, result, optimizer)
            run.train_step = step + 1
            run.bar.set_postfix(loss=f"{total:.4f}")
            run.end_step(step + 1, held_out)
        after = held_out(cfg.n_dpo_steps)
        return run.finish(after, before=before)
