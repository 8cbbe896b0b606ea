"""SFT: maximum-likelihood fine-tuning on (prompt, response) pairs, loss on the response tokens
only (CS336 A5 §4). The hyperparameters are the fields of ``SFTConfig``; the loop is ``train_sft``.

Data: an embedded task's worked solutions, a CS336 ``sft.jsonl`` of ``{prompt, response}`` (or
TRL's ``{prompt, completion}`` and ``{messages}``: conversations rendered by the chat template,
only the assistant's tokens trained), or a GSM8K/MATH JSONL (its reference solution in R1-Zero
form). Every response ends with the tokenizer's eos — a chat model's end-of-turn token — so the
model learns to stop (``append_eos``; TRL appends it too). ``filter_correct`` keeps only pairs
whose response the verifier accepts (CS336 §4.3); ``max_examples`` sets the dataset size.

Tool-using demonstrations: with ``env`` (a tool environment, as GRPO's), each response's tool calls
are replayed through the live tools (``envs.replay_demonstrations``): the observations are the ones
the model will read in its rollouts, tokenised as the rollouts tokenise them, and they leave the
loss (only the model's own tokens are imitated); validation samples through the environment.
With ``env: {tool_format: chat_template}`` a demonstration is a ``{messages}`` conversation with the
assistant's ``tool_calls`` (or a worked solution in the model's syntax), replayed and rendered as the
chat rollouts render it (``envs.replay_chat_demonstrations``): the model's turns trained, the
template's tool turns masked.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from ..core import pad_token_id
from ..data import SFTPair, TemplateError, conversation_segments
from ..data.prompts.chat import check_system_prompt_fits
from ..envs import ChatToolEnv, EnvBackend, replay_chat_demonstrations, replay_demonstrations
from ..rewards import RewardScorer
from ..training import distributed
from ..training.batching import ExampleSampler, accumulate_sft_gradient
from ..training.inputs import fitting_indices, load_sft_inputs
from ..training.optimization import effective_warmup, make_optimizer, make_scheduler
from ..training.resources import check_sampled_inputs, context_length
from ..training.run import Run, TrainResult
from ..training.run_config import EnvOptions
from ..training.run_setup import run_backend
from ..training.sampled_run_config import SampledRunConfig
from ..training.validation import validation


class SFTConfig(SampledRunConfig):
    """SFT's fields (CS336 A5 §4), beside the sampling ones its validation uses."""

    command, steps_field, step_key = "sft", "n_sft_steps", "sft_step"
    samples_with_vllm = True  # validation samples through the configured backend, synced before each
    # --- SFT: data
    filter_correct: bool = False
    """Keep only the pairs whose response the verifier accepts (CS336 §4.3); needs a ground truth per pair."""
    max_examples: int | None = Field(None, ge=1)
    """Train on the first this many pairs (CS336 sweeps the dataset size); null: all."""
    # --- SFT: optimisation
    n_sft_steps: int = Field(200, ge=1)
    """Optimizer steps (the run's length)."""
    learning_rate: float = Field(2e-5, gt=0)
    """AdamW's peak learning rate."""
    train_batch_size: int = Field(32, ge=1)
    """Pairs per optimizer step."""
    gradient_accumulation_steps: int = Field(4, ge=1)
    """Micro-batches per optimizer step (micro-batch = train_batch_size / this pairs): raise it to fit memory."""
    normalize_constant: float = Field(1.0, gt=0)
    """The loss is the sum of the response tokens' NLL divided by this (CS336's normalize_constant)."""
    warmup_steps: int = Field(1000, ge=0)
    """Linear learning-rate warm-up in optimizer steps, capped at 10 % of n_sft_steps."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """After warm-up: a constant learning rate, or cosine decay to 0 at the last step."""
    # --- SFT: responses
    env: EnvOptions = None
    """Tool-using demonstrations (envs.build_env's keys, as GRPO's env): each response's tool calls are replayed
    through the live tools, and the observations leave the loss."""
    append_eos: bool = True
    """End every response with the tokenizer's eos (a chat model's end-of-turn token), so the model learns to stop
    (TRL does too); false: responses as given."""
    # --- SFT: early stop
    stop_at_eval_accuracy: float | None = Field(None, gt=0, le=1)
    """Stop at the first periodic validation (every eval_every steps) whose accuracy reaches this; n_sft_steps is
    then the cap. Null: always n_sft_steps."""
    run_dir: str = "runs/sft"

    @model_validator(mode="after")
    def _check_stop(self):
        if self.stop_at_eval_accuracy is not None and not self.eval_every:
            raise ValueError("stop_at_eval_accuracy needs eval_every > 0 (the validations it stops at)")
        return self


def sft_pairs(cfg: SFTConfig, tokenizer=None):
    """(training pairs, inputs) with the correctness filter (guarded rewards) and the size cap applied."""
    pairs, inputs = load_sft_inputs(cfg, tokenizer)
    if cfg.filter_correct:
        if any(p.messages is not None for p in pairs):
            raise ValueError("filter_correct scores {prompt, response} pairs; a {messages} conversation has no single "
                             "response to verify")
        if inputs.reward is None:
            raise ValueError("filter_correct needs a reward (verifier)")
        if any(p.ground_truth is None for p in pairs):
            raise ValueError("filter_correct needs a ground truth for every pair ('ground_truth' field)")
        with RewardScorer(inputs.reward, timeout_s=cfg.reward_timeout_s, num_workers=cfg.reward_workers) as scorer:
            scores = scorer.score([p.response for p in pairs], [p.ground_truth for p in pairs])
        pairs = [p for p, s in zip(pairs, scores) if s["reward"] >= 1.0]
        if not pairs:
            raise ValueError("filter_correct kept no example: the verifier rejected every response")
    if cfg.max_examples is not None:
        pairs = pairs[: cfg.max_examples]
    return pairs, inputs


def response_eos_id(tokenizer, model=None) -> int:
    """The id that ends a response: the tokenizer's eos, else the first of the model's
    ``generation_config.eos_token_id``; neither is a one-line error (a response without an end
    token teaches the model never to stop)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if not isinstance(eos, int):
        raise ValueError("append_eos: the tokenizer has no eos token and the model's generation_config names none, so "
                         "responses would end with no end token: set the tokenizer's eos_token, or append_eos: false")
    return eos


def tokenize_pairs(pairs: list[SFTPair], tokenizer, env=None, append_eos: bool = False, eos_id: int | None = None,
                   template=None) -> list[tuple[list[int], list[int], list[bool] | None]]:
    """(prompt ids, response ids, loss mask) of each pair, prompt and response tokenised separately
    (CS336). With ``append_eos`` the eos id (``eos_id``, else ``response_eos_id``) ends every
    response whose ids do not end with it already. The mask is None (every response token) unless
    ``env`` replays tool calls (False on the observations; with ``tool_format: chat_template`` the
    template's tool turns, the prompts re-rendered with the tools by ``template``) or the pair is a conversation
    (``messages``: only the assistant turns and their end-of-turn tokens are trained, as TRL's
    ``assistant_only_loss``)."""
    eos = (eos_id if eos_id is not None else response_eos_id(tokenizer)) if append_eos else None
    if isinstance(env, ChatToolEnv):  # the model's own function calling: rendered as chat rollouts render it
        if template is not None:
            env.bind(template)  # the prompts show the tools, as in the run's rollouts
        rendered = getattr(template, "rendered", {})
        prompts = [template.format(rendered[p.prompt]) if p.messages is None and p.prompt in rendered else p.prompt
                   for p in pairs]
        responses = [p.messages[len(p.prompt):] if p.messages is not None else p.response for p in pairs]
        demos = replay_chat_demonstrations(env, tokenizer, prompts, responses, [p.source for p in pairs])
        return [_ended(d.prompt_ids, d.response_ids, d.loss_mask, eos) for d in demos]
    if env is not None:
        demos = replay_demonstrations(env, tokenizer, [p.prompt for p in pairs], [p.response for p in pairs])
        return [_ended(d.prompt_ids, d.response_ids, d.loss_mask, eos) for d in demos]
    out = []
    plain = [i for i, p in enumerate(pairs) if p.messages is None]
    prompts = tokenizer([pairs[i].prompt for i in plain], add_special_tokens=False)["input_ids"] if plain else []
    responses = tokenizer([pairs[i].response for i in plain], add_special_tokens=False)["input_ids"] if plain else []
    by_index = {i: (p, r) for i, p, r in zip(plain, prompts, responses)}
    for i, pair in enumerate(pairs):
        if i in by_index:
            out.append(_ended(*by_index[i], None, eos))
            continue
        try:
            prompt, pieces = conversation_segments(tokenizer, pair.messages)
        except TemplateError as exc:
            raise TemplateError(f"{pair.source}: {exc}" if pair.source else str(exc)) from None
        ids, mask = [], []
        for text, trained in pieces:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [trained] * len(piece)
        out.append(_ended(tokenizer(prompt, add_special_tokens=False)["input_ids"], ids, mask, eos))
    return out


def _ended(prompt_ids, response_ids, mask, eos):
    """The sequence with ``eos`` appended (trained) unless its last trained token is already it."""
    response_ids, mask = list(response_ids), None if mask is None else list(mask)
    if eos is not None and not (response_ids and response_ids[-1] == eos):
        response_ids.append(eos)
        if mask is not None:
            mask.append(True)
    return list(prompt_ids), response_ids, mask


def fitting_sequences(pairs: list[SFTPair], sequences: list, limit: int | None, on_error: str) -> tuple[list, list]:
    """(pairs, sequences) of the sequences that fit the context (``inputs.fitting_indices``)."""
    sizes = [(len(p) + len(r), f"prompt {len(p)} + response {len(r)}") for p, r, _ in sequences]
    kept = fitting_indices(sizes, [pair.source for pair in pairs], limit, on_error, "SFT sequence")
    return [pairs[i] for i in kept], [sequences[i] for i in kept]


def sft_check(pairs: list[SFTPair], inputs, cfg: SFTConfig):
    """(``check_inputs`` for the Run, ``checked``): before the run directory is touched, the system
    prompt and the validation prompts fit the context (GRPO's checks), and every pair is rendered
    and tokenised and its sequence fits the context. ``checked`` then holds the pairs kept, their
    sequences (tokenised once, here) and the eos id. Tool demonstrations are replayed through the
    live tools, which the Run builds after this check: those are tokenised and checked in the run."""
    sampled, checked = check_sampled_inputs(inputs, cfg, check_train=False), {}

    def check(model, tokenizer, device) -> None:
        limit = context_length(model)
        check_system_prompt_fits(inputs.template, tokenizer, limit, cfg.sampling_max_tokens if inputs.evals else 0,
                                 "sampling_max_tokens")
        sampled(model, tokenizer, device)
        checked["eos"] = response_eos_id(tokenizer, model) if cfg.append_eos else None
        if cfg.env is None:
            sequences = tokenize_pairs(pairs, tokenizer, append_eos=cfg.append_eos, eos_id=checked["eos"])
            checked["pairs"], checked["sequences"] = fitting_sequences(pairs, sequences, limit, cfg.data_on_error)

    return check, checked


def train_sft(cfg: SFTConfig, *, model=None, tokenizer=None, resume: bool = False, overwrite: bool = False,
              pairs: list[SFTPair] | None = None) -> TrainResult:
    """Run SFT as configured; ``model``/``tokenizer`` override ``cfg.model``, and ``pairs`` the
    training pairs of the config's data, used as given (``filter_correct`` and ``max_examples``
    apply to the config's pairs; the config's data still gives the validation questions)."""
    if pairs is None:
        pairs, inputs = sft_pairs(cfg, tokenizer)
    else:  # the config's pairs are not loaded, scored or filtered only to be replaced
        pairs, inputs = list(pairs), load_sft_inputs(cfg, tokenizer)[1]
    if not pairs:
        raise ValueError("no SFT pairs to train on")
    check, checked = sft_check(pairs, inputs, cfg)
    with Run(cfg, resume=resume, overwrite=overwrite, model=model, tokenizer=tokenizer, check_inputs=check) as run:
        model, tokenizer = run.model, run.tokenizer
        env = run.env  # built by Run before the run directory was touched
        if env is not None:  # tool demonstrations: replayed through the live tools now
            sequences = tokenize_pairs(pairs, tokenizer, env, cfg.append_eos, checked["eos"], inputs.template)
            pairs, sequences = fitting_sequences(pairs, sequences, context_length(run.sampling_model),
                                                 cfg.data_on_error)
        else:
            pairs, sequences = checked["pairs"], checked["sequences"]
        pad_id = pad_token_id(tokenizer)
        optimizer = run.track("optimizer", make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay))
        scheduler = run.track("scheduler", make_scheduler(
            optimizer, effective_warmup(cfg.warmup_steps, cfg.n_sft_steps), cfg.n_sft_steps, cfg.lr_schedule))
        sampler = run.track("data", ExampleSampler(len(pairs), cfg.seed))
        generator = run.track_rng("sampling", torch.Generator().manual_seed(cfg.seed))
        scorer = RewardScorer(inputs.reward, timeout_s=cfg.reward_timeout_s) if inputs.reward is not None else None
        backend = run_backend(run, generator)  # hf, or a vLLM engine / server (CS336: vLLM evaluates the policy)
        run.on_close(backend.close)
        measure = validation(run, EnvBackend(backend, env, template=inputs.template) if env is not None else backend,
                             inputs, cfg, scorer)
        reached = []  # (step, figures) of the validation whose accuracy reached stop_at_eval_accuracy

        def validate(step: int) -> dict:
            if run.weights.engine_holds_weights:  # the engine's own copy gets the current weights first
                run.weights.sync(backend)
            metrics = measure(step)
            if cfg.stop_at_eval_accuracy is not None and metrics.get("accuracy", 0.0) >= cfg.stop_at_eval_accuracy:
                reached.append((step, metrics))
            return metrics

        if cfg.eval_every and not run.resuming:
            validate(0)  # the starting point of the validation curve
        for step in run.steps():
            if reached:
                run.log({"sft/stopped_at_step": reached[0][0], "sft/stop_at_eval_accuracy": cfg.stop_at_eval_accuracy})
                run.bar.write(f"grpolab sft: validation accuracy {reached[0][1]['accuracy']:.1%} reached "
                              f"stop_at_eval_accuracy ({cfg.stop_at_eval_accuracy:.0%}) at step {reached[0][0]} of at "
                              f"most {cfg.n_sft_steps}: stopping")
                break
            batch = distributed.shard([sequences[i] for i in sampler.next(cfg.train_batch_size)])
            loss, nll, tok = accumulate_sft_gradient(run.model, batch, cfg.gradient_accumulation_steps,
                                                     cfg.normalize_constant, pad_id, run.device, run.autocast)
            result = run.optimizer_step(optimizer, scheduler, loss)
            run.log_update({"train_step": step, "train/loss": loss, "train/token_nll": nll / max(tok, 1.0)}, result,
                           optimizer)
            run.train_step = step + 1
            run.bar.set_postfix(nll=f"{nll / max(tok, 1.0):.3f}")
            run.end_step(step + 1, validate)
        after = reached[0][1] if reached else validate(cfg.n_sft_steps)
        if scorer is not None:
            scorer.close()
        return run.finish(after, n_examples=len(pairs))
