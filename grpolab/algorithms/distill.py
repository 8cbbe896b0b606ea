"""On-policy distillation: the student samples, a teacher scores every sampled token, and the
student minimises its per-token reverse KL to the teacher on its own samples (Agarwal et al. 2024,
GKD; Gu et al. 2024, MiniLLM; Thinking Machines' "On-policy distillation", 2025; Qwen3).

For each of ``n_distill_steps``: sample ``group_size`` responses for each of ``rollout_batch_size /
group_size`` prompts from the student, then one on-policy optimizer step over the batch in
micro-batches. The loss is one of:

- ``divergence: null`` (the default; the Thinking Machines form): each sampled token's reverse KL
  as a negative advantage, ``A_t = -(log p_student(x_t) - log p_teacher(x_t))``, through core's
  ``reinforce_with_baseline`` policy-gradient loss. Its expected gradient is that of
  KL(student || teacher) on the student's own samples; only the teacher's log-prob of each sampled
  token is needed (the teacher's log-probs are computed once per batch, in inference mode);
- ``divergence: forward_kl | reverse_kl | generalized_jsd`` (GKD's loss, ``beta``): core's
  full-vocabulary divergence at every sampled position, both models' output heads applied a chunk
  of positions at a time (``models.fused_head.response_divergence``), so a 49k-152k vocabulary never
  makes a (batch, seq, vocab) tensor.

``reward_weight > 0`` adds the task's verifier reward as GRPO's group-normalised advantage (every
token of a response) to the same policy-gradient term. Both models score softmax(logits /
``sampling_temperature``), the distribution the student sampled from. Observation tokens of tool
rollouts are context only: out of the loss and the KL figures. The teacher is frozen and replicated
on every rank under torchrun (its forwards need no other rank and no lockstep; a sharded teacher
would add a collective per micro-batch to save memory a frozen model in inference mostly does not
need); each rank scores its own groups.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from ..core import (
    LENGTH_NORMALIZATIONS,
    aggregate_token_loss,
    compute_advantages,
    compute_policy_gradient_loss,
    divergence_names,
    pad_token_id,
)
from ..envs import EnvBackend
from ..models import load_model_and_tokenizer, set_logits_fp32
from ..models.fused_head import response_divergence, response_log_probs
from ..models.loading import EMBEDDED_PREFIX, ModelLoadError
from ..rewards import RewardScorer
from ..rollout import make_backend
from ..training import distributed
from ..training.batching import (
    ExampleSampler,
    RolloutBatch,
    batched_log_probs,
    make_rollout_batch,
    plan_microbatches,
    take_rows,
)
from ..training.inputs import load_inputs
from ..training.metric_logging import plot_reward_curves
from ..training.optimization import effective_warmup, make_optimizer, make_scheduler
from ..training.resources import check_sampled_inputs
from ..training.run import ListState, Run, TrainResult
from ..training.run_config import EnvOptions
from ..training.sampled_run_config import PolicyUpdateConfig
from ..training.token_records import TokenRecorder
from ..training.validation import validation


class DistillConfig(PolicyUpdateConfig):
    """On-policy distillation's fields, beside those of ``PolicyUpdateConfig`` (whose batch fields it
    uses; one on-policy optimizer step per rollout batch)."""

    command, steps_field, step_key = "distill", "n_distill_steps", "distill_step"
    samples_with_vllm = True
    groups_on_one_rank = uneven_micro_batches = True  # a group's reward baseline stays on its rank
    method_defaults = dict(rollout_batch_size=64, group_size=4, train_batch_size=64, gradient_accumulation_steps=4,
                           learning_rate=1e-4, warmup_steps=0, kl_stop=None)
    # --- On-policy distillation
    n_distill_steps: int = Field(100, ge=1)
    """Outer steps: each samples a rollout batch from the student and takes one optimizer step on it."""
    teacher: str | None = None
    """The teacher: any model that loads in grpolab (a Hugging Face directory, a LoRA final/, embedded:NAME), with the
    student's tokenizer and vocabulary (checked)."""
    teacher_dtype: Literal["float32", "bfloat16"] | None = None
    """The teacher's weights' dtype. null: float32 as the student's (dtype bfloat16 autocasts both alike, logits_fp32
    puts both heads in fp32: teacher = student gives 0 advantage); bfloat16: half the memory, with bf16 rounding."""
    divergence: str | None = None
    """null: each sampled token's reverse KL as a negative advantage (Thinking Machines); a name in core's
    divergence registry (forward_kl, reverse_kl, generalized_jsd): GKD's full-vocabulary loss at sampled positions."""
    beta: float = Field(0.5, ge=0, le=1)
    """generalized_jsd's mixture weight (GKD's beta): 0 is forward KL, 1 reverse KL."""
    reward_weight: float = Field(0.0, ge=0)
    """Weight of the task's verifier reward, as GRPO's group-normalised advantage added to the loss's signal
    (0: the teacher alone; no reward needed)."""
    length_normalization: str = "token_mean"
    """How token losses become one: token_mean (every sampled token alike), masked_mean (per response, then
    over responses) or masked_normalize (a response's sum / sampling_max_tokens)."""
    advantage_eps: float = Field(1e-6, ge=0)
    """reward_weight > 0: added to a group's reward std before dividing."""
    env: EnvOptions = None
    """A tool environment (envs.build_env's keys): tool calls run between turns; observation tokens are
    context only, out of the loss and the KL."""
    run_dir: str = "runs/distill"

    @field_validator("divergence")
    @classmethod
    def _registered(cls, value: str | None) -> str | None:
        if value is not None and value not in divergence_names():
            raise ValueError(f"unknown divergence; expected null or one of {', '.join(divergence_names())}")
        return value

    @field_validator("length_normalization")
    @classmethod
    def _normalization(cls, value: str) -> str:
        if value not in LENGTH_NORMALIZATIONS:
            raise ValueError(f"unknown length_normalization; expected one of {', '.join(LENGTH_NORMALIZATIONS)}")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.train_batch_size != self.rollout_batch_size:
            raise ValueError(f"train_batch_size ({self.train_batch_size}) must equal rollout_batch_size "
                             f"({self.rollout_batch_size}): distillation takes one on-policy step per rollout batch")
        if self.kl_coef > 0:
            raise ValueError("kl_coef: distillation's KL is to the teacher; a KL to the starting policy is not offered")
        return self


# ---------------------------------------------------------------- the teacher


def load_teacher(cfg: DistillConfig, student, tokenizer, device):
    """The frozen teacher, checked against the student: the same vocabulary (the tokens are the
    student's ids) and not the student itself (a warning: the KL would be 0 and nothing learned).
    Scored as the student is: fp32 weights unless ``teacher_dtype: bfloat16``, the run's autocast,
    and an fp32 head when the run has ``logits_fp32``."""
    path = cfg.teacher
    if not path.startswith(EMBEDDED_PREFIX):
        path = str(Path(path).expanduser())
        if not Path(path).exists():
            raise ModelLoadError(f"teacher {cfg.teacher}: no such model directory")
        if Path(path).is_dir() and not (Path(path) / "config.json").exists():  # D06: a run directory
            inner = next((Path(path) / d for d in ("final", "model") if (Path(path) / d / "config.json").exists()),
                         None)
            raise ModelLoadError(f"teacher {cfg.teacher}: no config.json, not a Hugging Face model directory"
                                 + (f"; a run directory? give its model: --teacher {inner}" if inner else ""))
    # the student's precision: fp32 weights (dtype bfloat16 is autocast over them) and the same head (C5-1)
    teacher, teacher_tokenizer = load_model_and_tokenizer(path, dtype=cfg.teacher_dtype or "float32", device=device,
                                                          seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    if getattr(cfg, "logits_fp32", False):
        set_logits_fp32(teacher)
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"teacher {cfg.teacher}: its tokenizer differs from the student's ({len(teacher_tokenizer)} "
                         f"vs {len(tokenizer)} tokens): on-policy distillation scores the student's own token ids")
    # D08/D10: a NaN/inf weight, found before the run directory (and a resumed run's metrics) is touched
    broken = next((name for name, p in teacher.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if broken is not None:
        raise ValueError(f"teacher {cfg.teacher}: its weight {broken} holds NaN or inf: a broken model")
    sizes = [m.get_input_embeddings().weight.shape[0] for m in (teacher, student)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"teacher {cfg.teacher}: vocabulary of {sizes[0]} rows, the student's has {sizes[1]}")
    student_weights = dict(student.named_parameters())
    if all(name in student_weights and torch.equal(value, student_weights[name].to(value))
           for name, value in teacher.named_parameters()):
        warnings.warn(f"teacher {cfg.teacher}: has the student's weights: the KL is 0 and nothing is learned",
                      UserWarning, stacklevel=2)
    return teacher.eval().requires_grad_(False)


def teacher_log_probs(teacher, batch: RolloutBatch, cfg: DistillConfig, device, autocast, step: int) -> torch.Tensor:
    """The teacher's log-probs of every sampled token (label layout), once per batch; a non-finite
    one at a response token is one line naming the step and the row."""
    rows_per_pass = max(1, cfg.train_batch_size // cfg.gradient_accumulation_steps)
    lp = batched_log_probs(teacher, batch, rows_per_pass, device, autocast, cfg.policy_temperature)
    bad = ~torch.isfinite(lp) & batch.response_mask
    if bad.any():
        row, pos = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"teacher {cfg.teacher}: non-finite log-prob at step {step}, response {row}, token "
                         f"{pos - len(batch.sequences[row][0]) + 1}: its weights or logits hold NaN or inf")
    return lp


def reverse_kl_figures(student_lp: torch.Tensor, teacher_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The sampled estimate of KL(student || teacher) per token (mean of log p_s - log p_t over the
    masked tokens) and per response (its sum over a response's tokens, averaged)."""
    gap = (student_lp - teacher_lp) * mask
    tokens = max(int(mask.sum()), 1)
    return {"reverse_kl": float(gap.sum()) / tokens, "reverse_kl_per_response": float(gap.sum(1).mean())}


def heldout_kl(run: Run, teacher, cfg: DistillConfig, backend):
    """``on_samples`` of validation: the student's reverse KL to the teacher on held-out samples, both
    log-probs at ``sampling_temperature`` and the samples drawn there too (C5-5): validation's own when
    ``eval_temperature`` is the same, else a second draw from ``backend`` for the same prompts, seeded
    as validation is (samples at another temperature would average over another distribution: not a KL)."""
    pad_id = pad_token_id(run.tokenizer)
    redraw = cfg.eval_temperature != cfg.policy_temperature
    sampling = replace(cfg.eval_sampling_params(), temperature=cfg.policy_temperature)

    def measure(rollouts) -> dict[str, float]:
        if redraw:
            rollouts = backend.generate([r.prompt for r in rollouts], 1, sampling,
                                        prompt_ids=[r.prompt_ids for r in rollouts])
        batch = make_rollout_batch(rollouts, torch.zeros(len(rollouts)), torch.zeros(len(rollouts)), pad_id)
        rows = max(1, cfg.train_batch_size // cfg.gradient_accumulation_steps)
        student = batched_log_probs(run.sampling_model, batch, rows, run.device, run.autocast, cfg.policy_temperature)
        teacher_lp = batched_log_probs(teacher, batch, rows, run.device, run.autocast, cfg.policy_temperature)
        return reverse_kl_figures(student, teacher_lp, batch.response_mask)

    return measure


# ---------------------------------------------------------------- the update


def microbatch_loss(run: Run, teacher, mb: dict, cfg: DistillConfig, counts: tuple, n_micro: int):
    """One micro-batch's scaled loss (backward taken) and its per-token figures: the student's and
    the teacher's log-probs of the sampled tokens, and the full-vocabulary divergence where used."""
    mask, temperature = mb["response_mask"], cfg.policy_temperature
    with run.autocast():
        if cfg.divergence is None:
            student_lp = response_log_probs(run.model, mb["input_ids"], mb["labels"],
                                            temperature=temperature)["log_probs"].float()
            teacher_lp, per_token = mb["teacher_log_probs"], 0.0
        else:
            out = response_divergence(run.model, teacher, mb["input_ids"], mb["labels"], mask, cfg.divergence,
                                      beta=cfg.beta, temperature=temperature)
            student_lp, teacher_lp = out["student_log_probs"].float(), out["teacher_log_probs"].float()
            per_token = torch.zeros(mask.shape, dtype=out["divergence"].dtype, device=mask.device)
            per_token = per_token.masked_scatter(mask, out["divergence"])
    # the signal: the sampled reverse KL as a negative advantage, and/or the group-normalised reward
    signal = cfg.reward_weight * mb["advantages"]
    if cfg.divergence is None:
        signal = signal + (teacher_lp - student_lp.detach())
    if cfg.divergence is None or cfg.reward_weight:
        pg, _ = compute_policy_gradient_loss(student_lp, "reinforce_with_baseline", advantages=signal)
        per_token = per_token + pg
    tokens, rows = counts
    loss = aggregate_token_loss(per_token, mask, n_micro, cfg.length_normalization, float(cfg.sampling_max_tokens),
                                global_num_tokens=tokens, global_batch_size=rows)
    loss.backward()
    divergence = per_token.detach() if cfg.divergence is not None else None
    return loss.detach(), student_lp.detach(), teacher_lp.detach(), divergence


def distill_update(run: Run, teacher, batch: RolloutBatch, cfg: DistillConfig, optimizer, scheduler) -> dict:
    """One on-policy optimizer step over the rollout batch in micro-batches (rows planned by length;
    the loss is scaled by the whole batch's token or row count, global across ranks, so the gradient
    does not depend on the split). Returns the step's figures and the per-token log-probs."""
    tensors = batch.tensors()
    if batch.ref_log_probs is not None:
        tensors["teacher_log_probs"] = batch.ref_log_probs
    rows = [i for i in range(len(batch.sequences)) if batch.response_mask[i].any()]
    counts = (distributed.grad_normaliser(batch.response_mask.sum(), minimum=1),
              distributed.grad_normaliser(len(batch.sequences)))
    lengths = [int(batch.response_mask[i].nonzero().max()) + 1 for i in rows]
    plans = [[rows[i] for i in plan] for plan in plan_microbatches(lengths, cfg.gradient_accumulation_steps, None)]
    plans = [plan for plan in plans if plan]
    student_lp, teacher_lp = torch.zeros(batch.labels.shape), torch.zeros(batch.labels.shape)
    divergence, loss = torch.zeros(batch.labels.shape), 0.0
    for plan in plans:
        mb = take_rows(tensors, plan, run.device)
        part, s_lp, t_lp, div = microbatch_loss(run, teacher, mb, cfg, counts, len(plans))
        width = s_lp.shape[1]
        student_lp[plan, :width], teacher_lp[plan, :width] = s_lp.cpu(), t_lp.cpu()
        if div is not None:
            divergence[plan, :width] = div.cpu().float()
        loss += float(part)
    for _ in range(distributed.padding_micro_batches(len(plans))):
        distributed.dummy_backward(run.model)  # sharded engines: the same number of backwards on every rank
    loss = float(distributed.all_reduce(torch.tensor(loss, dtype=torch.float64)))
    result = run.optimizer_step(optimizer, scheduler, loss)
    mask = batch.response_mask
    figures = {f"distill/{k}": v for k, v in reverse_kl_figures(student_lp, teacher_lp, mask).items()}
    if cfg.divergence is not None:
        figures[f"distill/{cfg.divergence}"] = float((divergence * mask).sum()) / max(int(mask.sum()), 1)
    record = run.update_record({"train_step": run.train_step, "train/loss": loss,
                                "train/tokens_trained": int(mask.sum()), **figures}, result, optimizer)
    run.train_step += 1
    return {"record": record, "student_lp": student_lp, "teacher_lp": teacher_lp}


# ---------------------------------------------------------------- the loop


def sample_and_score(backend, scorer, sampler, inputs, cfg: DistillConfig, sampling):
    """(examples, rollouts, scores) of one rollout batch: each rank samples ``group_size`` responses
    for its share of the prompts; scores are the verifier's where there are answers, else empty."""
    examples = distributed.shard([inputs.train[i] for i in sampler.next(cfg.rollout_batch_size // cfg.group_size)])
    rollouts = backend.generate([inputs.template.format(e.question) for e in examples], cfg.group_size, sampling)
    if scorer is None:
        return examples, rollouts, [{} for _ in rollouts]
    scores = scorer.score([r.scored_response for r in rollouts], [examples[r.prompt_index].answer for r in rollouts],
                          prompts=[r.prompt for r in rollouts],
                          questions=[examples[r.prompt_index].question for r in rollouts], rollouts=rollouts)
    return examples, rollouts, scores


def train_distill(cfg: DistillConfig, *, model=None, tokenizer=None, resume: bool = False,
                  overwrite: bool = False) -> TrainResult:
    """Distil ``cfg.teacher`` into the student (``cfg.model``, or ``model``/``tokenizer``) on its own
    samples; ``resume`` continues from the newest checkpoint in ``cfg.run_dir``."""
    if not cfg.teacher:  # a field with no default would leave `grpolab config distill` nothing to print
        raise ValueError("teacher: give the teacher model (a model directory, a LoRA final/ or embedded:NAME)")
    inputs = load_inputs(cfg, tokenizer)
    answered = inputs.reward is not None and all(e.answer is not None for e in inputs.train)
    if cfg.reward_weight and not answered:
        raise ValueError("reward_weight > 0 needs answers to score: this data has prompts only (answer_field null)")
    check, teachers = check_sampled_inputs(inputs, cfg), []

    def check_inputs(student, student_tokenizer, device) -> None:  # the teacher too, before the directory is touched
        check(student, student_tokenizer, device)
        teachers.append(load_teacher(cfg, student, student_tokenizer, device))

    with Run(cfg, resume=resume, overwrite=overwrite, model=model, tokenizer=tokenizer,
             check_inputs=check_inputs) as run:
        model, tokenizer, teacher = run.model, run.tokenizer, teachers[0]
        scorer = RewardScorer(inputs.reward, timeout_s=cfg.reward_timeout_s, num_workers=cfg.reward_workers,
                              device=run.device) if answered else None
        optimizer = run.track("optimizer", make_optimizer(model, cfg.learning_rate, cfg.betas, cfg.weight_decay))
        scheduler = run.track("scheduler", make_scheduler(optimizer, effective_warmup(
            cfg.warmup_steps, cfg.n_distill_steps), cfg.n_distill_steps, cfg.lr_schedule))
        sampler = run.track("data", ExampleSampler(len(inputs.train), cfg.seed))
        generator = run.track_rng("sampling", torch.Generator().manual_seed(cfg.seed))
        samples = run.track("samples_drawn", ListState([0]))
        backend = make_backend(cfg.rollout_backend, run.sampling_model, tokenizer, generator=generator,
                               max_batch_size=cfg.rollout_max_batch_size,
                               autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None,
                               **cfg.backend_options())
        run.on_close(backend.close)
        if run.env is not None:  # multi-turn: tool calls between turns, observations masked from the loss
            backend = EnvBackend(backend, run.env, template=inputs.template)
        pad_id, sampling = pad_token_id(tokenizer), cfg.sampling_params()
        recorder = TokenRecorder(run.path, cfg.token_record_groups, cfg.seed, enabled=run.is_main,
                                 resume_step=run.step if run.resuming else None)
        validate = validation(run, backend, inputs, cfg, scorer, on_samples=heldout_kl(run, teacher, cfg, backend))
        before = validate(0) if not run.resuming else None

        for step in run.steps():
            # 1. the student samples a group of responses per prompt; 2. the verifier's reward where
            #    there are answers (a figure; with reward_weight, a signal too)
            examples, rollouts, scores = sample_and_score(backend, scorer, sampler, inputs, cfg, sampling)
            samples.items[0] += distributed.all_reduce(len(rollouts))
            rewards = torch.tensor([s.get("reward", 0.0) for s in scores], dtype=torch.float32)
            advantages = compute_advantages("grpo", rewards, cfg.group_size, advantage_eps=cfg.advantage_eps) \
                if cfg.reward_weight else torch.zeros_like(rewards)
            batch = make_rollout_batch(rollouts, rewards, advantages, pad_id)
            # 3. the teacher's log-probs of exactly the sampled ids (sampled-KL loss), once per batch
            if cfg.divergence is None:
                batch.ref_log_probs = teacher_log_probs(teacher, batch, cfg, run.device, run.autocast, step)
            # 4. one on-policy step; a backend with its own copy of the weights (vLLM) gets the new ones
            update = distill_update(run, teacher, batch, cfg, optimizer, scheduler)
            run.weights.sync(backend)
            # 5. figures and the viewer's per-token records (teacher - student log-prob as the advantage)
            record = update["record"]
            lengths = [len(r.response_ids) for r in rollouts]
            record.update({cfg.step_key: step, "samples_drawn": samples.items[0],
                           "rollout/response_length": sum(lengths) / len(lengths),
                           "rollout/truncation_rate": sum(r.finish_reason == "length" for r in rollouts)
                           / len(rollouts)})
            if scorer is not None:
                record["train/reward"] = float(rewards.mean())
            if not math.isfinite(record["train/loss"]):
                warnings.warn(f"step {step}: non-finite distillation loss; the optimizer step was skipped",
                              UserWarning, stacklevel=1)
            run.log(record)
            gap = (update["teacher_lp"] - update["student_lp"]) * batch.response_mask
            recorder.record(step, rollouts, scores, cfg.group_size, tokenizer,
                            {"sampler_lp": batch.sampler_log_probs, "trainer_lp": update["student_lp"],
                             "teacher_lp": update["teacher_lp"]}, gap, examples)
            run.bar.set_postfix(kl=f"{record['distill/reverse_kl']:.3f}")
            run.end_step(step + 1, validate)

        after = validate(run.total_steps)
        if scorer is not None:
            scorer.close()
        return run.finish(after, before=before, plot=lambda metrics, out: plot_reward_curves(
            metrics, out, f"distillation: {run.path.name}", cfg.step_key))
