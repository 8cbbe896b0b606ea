"""GRPO's policy update: the old and reference log-probs of a rollout batch, then
``epochs_per_rollout_batch`` passes of optimizer steps with the KL early stop (``policy_update``).

Under it, the gradient of one optimizer batch, accumulated over micro-batches — the engineering
kept apart from the algorithm: rows that cannot contribute are skipped, rows may be packed by a
token budget, and each distinct prompt may be run once for its whole group
(``models.shared_prefix``). None of it changes the gradient (tested to 1e-6 against the plain
fixed-micro-batch gradient), because every loss is scaled by the whole optimizer batch's
sequence or token count. Across ranks those counts are global (``distributed.grad_normaliser``), so
N processes take the single-process gradient of the same rows (tested to 1e-6 with 2 processes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core import grpo_microbatch_train_step, importance_sampling_weights, kl_k3
from ..models.shared_prefix import (
    label_to_response_layout,
    prompt_key,
    response_to_label_layout,
    shared_prefix_rows,
    supports_shared_prefix,
)
from ..training import distributed
from ..training.batching import (
    RolloutBatch,
    batched_log_probs,
    optimizer_batch_count,
    optimizer_batches,
    plan_microbatches,
    take_rows,
)
from ..training.packing import micro_batch_log_probs, use_packing
from ..training.run import Run

if TYPE_CHECKING:
    from .grpo import GRPOConfig


def microbatch_log_probs(model, tensors, batch: RolloutBatch, live: list[int], shared: bool, device, autocast,
                         temperature: float, packed: bool = False):
    """(micro-batch tensors, log-probs, entropy, a function taking a micro-batch per-token tensor to the
    rollout batch's label layout (on the CPU)) of rows ``live``. With ``shared``, each distinct prompt
    is run once for all its responses (``models.shared_prefix``); else with ``packed`` the rows go
    through the model as one padding-free sequence (``training.packing``)."""
    if not shared:
        mb = take_rows(tensors, live, device)
        with autocast():
            out = micro_batch_log_probs(model, mb["input_ids"], mb["labels"], mb["response_mask"].bool(), packed,
                                        return_token_entropy=True, temperature=temperature)
        return mb, out["log_probs"].float(), out["token_entropy"], lambda values: values.detach().cpu()
    with autocast():
        out = shared_prefix_rows(model, batch.sequences, live, batch.pad_id, device, temperature=temperature,
                                 return_token_entropy=True)
    p_lens, r_lens, index = out["prompt_lengths"], out["response_lengths"], torch.tensor(live)
    # the batch's mask, not the sequences': it also removes observation tokens (multi-turn rollouts)
    mask = label_to_response_layout(tensors["response_mask"][index], p_lens, r_lens).to(device)
    mb = {"response_mask": out["response_mask"] & mask, "advantages": tensors["advantages"][index].to(device),
          "raw_rewards": tensors["raw_rewards"][index].to(device)}
    for key in ("old_log_probs", "ref_log_probs", "is_weights"):
        if key in tensors:
            mb[key] = label_to_response_layout(tensors[key][index], p_lens, r_lens).to(device)
    width = tensors["labels"].shape[1]
    return mb, out["log_probs"].float(), out["token_entropy"], \
        lambda values: response_to_label_layout(values, p_lens, r_lens, width)


def forward_tokens(sequences, rows: list[int], shared: bool) -> int:
    """Tokens a micro-batch of ``rows`` puts through the model, padding not counted: each row's
    prompt and response, or with ``shared`` each distinct prompt once (the speed benchmark's FLOPs)."""
    responses = sum(len(sequences[r][1]) for r in rows)
    if shared:
        return responses + sum(len(sequences[r][0]) for r in {prompt_key(sequences[r]): r for r in rows}.values())
    return responses + sum(len(sequences[r][0]) for r in rows)


def pass_tokens(sequences, passes: list[list[int]], shared: bool) -> int:
    """Tokens the forwards of ``passes`` (lists of rows) compute, padding included: each pass pads its
    rows to its longest; with ``shared``, its distinct prompts to the longest prompt, run once, and its
    responses to the longest response."""
    total = 0
    for rows in passes:
        if shared:
            prompts = {prompt_key(sequences[r]): len(sequences[r][0]) for r in rows}
            total += len(prompts) * max(prompts.values()) + len(rows) * max(len(sequences[r][1]) for r in rows)
        else:
            total += len(rows) * max(len(sequences[r][0]) + len(sequences[r][1]) for r in rows)
    return total


def fewer_padded_tokens(sequences, passes: list[list[int]], rows_per_pass: int, shared: bool) -> list[list[int]]:
    """``passes`` (rows in batch order: a group's responses together, its prompt run once per pass),
    or the same rows sorted by response length in passes of ``rows_per_pass`` (little padding, but
    a pass may hold several prompts), whichever computes fewer tokens. The gradient is the same
    either way (every loss is scaled by the whole batch's counts)."""
    ranked = sorted((r for rows in passes for r in rows), key=lambda r: len(sequences[r][1]))
    by_length = [ranked[i : i + rows_per_pass] for i in range(0, len(ranked), rows_per_pass)]
    return by_length if pass_tokens(sequences, by_length, shared) < pass_tokens(sequences, passes, shared) else passes


def loss_ratio(meta: dict, log_probs: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per token, the importance ratio the loss weighed and clipped, as the loss reported it (GSPO:
    its sequence ratio ``s_i`` at every token of the response, whose clip flags the records show);
    ``exp(log pi - log pi_old)`` for a loss without one. For the token records only: no gradient."""
    ratio = meta["ratio"] if "ratio" in meta else torch.exp(log_probs - old)
    return ratio.detach().float()


def trained_signal(batch: RolloutBatch, cfg) -> torch.Tensor:
    """What the loss multiplies each response's log-probs by: the raw reward under ``no_baseline``,
    else the advantage (what the token records show as ``advantage``)."""
    return batch.raw_rewards if cfg.loss_type == "no_baseline" else batch.advantages


def accumulate_policy_gradient(model, batch: RolloutBatch, rows: list[int], cfg, contributes: torch.Tensor,
                               kl_coef: float, device, autocast, trainer_lp: torch.Tensor | None = None,
                               token_stats: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Forward/backward one optimizer batch (``rows``) in micro-batches, leaving its gradient in
    ``.grad``; returns summed figures for logging and, when given ``trainer_lp``, fills in the
    trainer's log-probs of the trained rows (for the sampler/trainer mismatch check). ``token_stats``
    (label-layout tensors ``entropy``, ``ratio``, ``clipped``, e.g. from ``token_records.empty_stats``)
    gets each trained token's figures from the last pass that trained it (the viewer's per-token records).

    Rows that cannot contribute (zero advantage and no KL term; empty responses) are skipped, and
    losses are scaled by the whole batch's sequence (or token) count, so the gradient equals the
    fixed-micro-batch gradient whether or not rows are skipped and however rows are packed. In a
    distributed run ``rows`` are this rank's share, the counts are global, the returned figures are
    summed over ranks, and sharded engines run the same number of micro-batches on every rank."""
    tensors = batch.tensors()
    mask_all = batch.response_mask[rows]
    global_tokens = distributed.grad_normaliser(mask_all.sum(), minimum=1)
    global_rows = distributed.grad_normaliser(len(rows))
    lengths = [int(m.nonzero().max()) + 1 if m.any() else 1 for m in mask_all]
    plans = plan_microbatches(lengths, cfg.gradient_accumulation_steps, cfg.micro_batch_token_budget)
    sums = {"loss": 0.0, "entropy": 0.0, "clip": 0.0, "approx_kl": 0.0, "kl": 0.0, "tokens": 0.0, "forward_tokens": 0.0}
    # sharded engines need one forward per micro-batch on every rank: no two-pass prompt sharing there
    shared = cfg.share_prompt_prefix and supports_shared_prefix(model) and not distributed.current().sharded
    packed = not shared and use_packing(model, cfg.packing, distributed.current().sharded)
    normalize_constant = cfg.normalize_constant or float(cfg.sampling_max_tokens)
    live_plans = [live for live in ([rows[i] for i in plan if contributes[rows[i]]] for plan in plans) if live]
    if cfg.micro_batch_token_budget is None and len(live_plans) > 1:
        live_plans = fewer_padded_tokens(batch.sequences, live_plans, len(plans[0]), shared)
    padding = distributed.padding_micro_batches(len(live_plans))
    for live in live_plans:
        mb, log_probs, entropy, to_label_layout = microbatch_log_probs(model, tensors, batch, live, shared, device,
                                                                       autocast, cfg.policy_temperature, packed)
        label_lp = to_label_layout(log_probs)
        sums["forward_tokens"] += forward_tokens(batch.sequences, live, shared)
        if trainer_lp is not None:
            trainer_lp[live, : label_lp.shape[1]] = label_lp
        old = mb.get("old_log_probs", log_probs.detach())
        # the global sizes set the loss scale, so the micro-batch count given here is not used
        loss, meta = grpo_microbatch_train_step(
            log_probs, mb["response_mask"], len(plans), cfg.loss_type,
            raw_rewards=mb["raw_rewards"], advantages=mb["advantages"], old_log_probs=old,
            cliprange=cfg.cliprange, cliprange_high=cfg.cliprange_high,
            length_normalization=cfg.length_normalization, normalize_constant=normalize_constant,
            global_num_tokens=global_tokens, global_batch_size=global_rows,
            ref_log_probs=mb.get("ref_log_probs"), kl_coef=kl_coef, kl_estimator_name=cfg.kl_estimator,
            is_weights=mb.get("is_weights"), token_entropy=entropy if cfg.entropy_coef else None,
            entropy_coef=cfg.entropy_coef, loss_options=cfg.loss_options(),
        )
        # figures stay on the device until the optimizer step: one sync per step, not per micro-batch
        mask = mb["response_mask"]
        n_tok = mask.sum()
        sums["loss"] += loss
        sums["tokens"] += n_tok
        sums["entropy"] += (entropy.detach().float() * mask).sum()
        sums["approx_kl"] += (kl_k3(old, log_probs.detach()) * mask).sum()
        if "clip_fraction" in meta:
            sums["clip"] += meta["clip_fraction"] * n_tok
        if token_stats is not None:
            figures = {"entropy": entropy.detach().float(), "ratio": loss_ratio(meta, log_probs, old),
                       "clipped": meta.get("clipped", torch.zeros_like(mask)).float()}
            for key, values in figures.items():
                token_stats[key][live, : label_lp.shape[1]] = to_label_layout(values)
        if "kl" in meta:
            sums["kl"] += meta["kl"] * n_tok
    for _ in range(padding):
        distributed.dummy_backward(model)
    return {k: float(distributed.all_reduce(torch.as_tensor(v, dtype=torch.float64))) for k, v in sums.items()}


# ---------------------------------------------------------------- the update of a rollout batch


def old_and_reference_log_probs(run: Run, batch: RolloutBatch, cfg: GRPOConfig, ref_model) -> dict[str, float]:
    """Old-policy log-probs (off-policy, or for the sampler/trainer IS correction) and the reference
    policy's, once per rollout batch; with the correction, the IS weights and their figures."""
    rows_per_pass = max(1, cfg.train_batch_size // cfg.gradient_accumulation_steps)
    correct = cfg.is_correction != "none"
    # asynchronous and on-policy, the IS weights matter only on rows that reach the loss: the others are not
    # forwarded (synchronous runs keep every row's old log-probs: their sampler/trainer mismatch figure is of all)
    needed = None
    if correct and not cfg.off_policy and cfg.max_staleness and not distributed.current().sharded:
        signal = trained_signal(batch, cfg)
        regularised = ref_model is not None or cfg.entropy_coef > 0 or not cfg.skip_zero_advantage
        needed = batch.response_mask.any(1) & ((signal != 0) | regularised)
    if cfg.off_policy or correct:
        only = None if needed is None or bool(needed.all()) else needed.nonzero().flatten().tolist()
        batch.old_log_probs = batched_log_probs(run.model, batch, rows_per_pass, run.device, run.autocast,
                                                cfg.policy_temperature, only=only, fill=batch.sampler_log_probs)
        # the trainer's log-prob of every sampled token, for the mismatch figure, where every row was forwarded
        batch.pre_update_log_probs = batch.old_log_probs if only is None else None
    if ref_model is not None:
        batch.ref_log_probs = batched_log_probs(ref_model, batch, rows_per_pass, run.device, run.autocast,
                                                cfg.policy_temperature)
    if not correct:
        return {}
    mask = batch.response_mask if needed is None else batch.response_mask & needed.unsqueeze(1)
    batch.is_weights, stats = importance_sampling_weights(
        batch.old_log_probs, batch.sampler_log_probs, mask, mode=cfg.is_correction,
        level=cfg.importance_sampling_level, cap=cfg.importance_sampling_cap,
        mask_low=cfg.importance_sampling_mask_low, mask_high=cfg.importance_sampling_mask_high)
    if not cfg.off_policy:
        batch.old_log_probs = None  # on-policy: the ratio is computed against the current forward
    if not distributed.all_reduce(int(mask.any()), "max"):
        return {}  # no row reaches the loss: nothing was measured, which is no figure (not a ratio of 0)
    return {f"train/{k}": float(v) for k, v in stats.items()}


@dataclass
class Update:
    """What one rollout batch's policy update did: a record per applied optimizer step, whether
    the KL early stop fired, and the trainer's log-probs of the sampled tokens (where known)."""

    records: list[dict]
    stopped_early: bool
    skipped_kl_stop: int  # optimizer steps of the rollout batch not taken because the KL early stop fired
    applied_steps: int  # optimizer steps that changed the weights (not stopped, not skipped as non-finite)
    trainer_lp: torch.Tensor
    trained: torch.Tensor
    mean_kl: float | None


def policy_update(run: Run, batch: RolloutBatch, cfg: GRPOConfig, optimizer, scheduler, kl_ctl, has_reference: bool,
                  step: int, token_stats: dict | None = None) -> Update:
    """``epochs_per_rollout_batch`` passes over the rollout batch in optimizer batches (reshuffled
    each epoch when off-policy), with the KL early stop measured before each optimizer step;
    ``token_stats`` (``token_records.empty_stats``) gets the trained tokens' entropy, ratio and clip."""
    n = len(batch.sequences)
    trainer_lp = batch.old_log_probs.clone() if cfg.off_policy else torch.zeros(batch.labels.shape)
    trained = torch.full((n,), cfg.off_policy, dtype=torch.bool)
    signal = trained_signal(batch, cfg)
    has_tokens = batch.response_mask.any(1)  # an empty response never reaches the loss (0/0)
    # a row with zero advantage has zero gradient unless a KL or entropy term acts on it
    regularised = (has_reference and kl_ctl.value > 0) or cfg.entropy_coef > 0
    contributes = has_tokens & ((signal != 0) | regularised | (not cfg.skip_zero_advantage))
    shuffle = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    records, kl_values, stopped, applied = [], [], False, 0
    planned = cfg.epochs_per_rollout_batch * optimizer_batch_count(n, cfg.train_batch_size)
    for epoch in range(cfg.epochs_per_rollout_batch):
        for rows in optimizer_batches(
            n, cfg.train_batch_size, cfg.off_policy, shuffle, [s[2] for s in batch.sequences]
        ):
            record_lp = trainer_lp if epoch == 0 and not cfg.off_policy else None
            sums = accumulate_policy_gradient(run.model, batch, rows, cfg, contributes, kl_ctl.value, run.device,
                                              run.autocast, record_lp, token_stats)
            if record_lp is not None:
                trained[rows] = contributes[rows]
            tok = max(sums["tokens"], 1.0)
            approx_kl = sums["approx_kl"] / tok
            if cfg.kl_stop is not None and cfg.off_policy and approx_kl > cfg.kl_stop:
                optimizer.zero_grad(set_to_none=True)  # measured before the step: this update is not applied
                stopped = True
                run.bar.write(f"grpolab health: grpo step {step}: KL early stop (approx KL(old || current) "
                              f"{approx_kl:.4g} > kl_stop {cfg.kl_stop}): {planned - len(records)} of {planned} "
                              "optimizer updates of this rollout batch skipped (kl_stop: null turns it off)")
                break
            result = run.optimizer_step(optimizer, scheduler, sums["loss"])
            applied += not result.skipped
            record = run.update_record({
                "train_step": run.train_step, "grpo_step": step, "epoch": epoch,
                "train/loss": sums["loss"], "train/token_entropy": sums["entropy"] / tok,
                "train/clip_fraction": sums["clip"] / tok, "train/approx_kl_old_new": approx_kl,
                "train/kl_coef": kl_ctl.value,
                "train/rows_trained": int(contributes[rows].sum()), "train/tokens_trained": int(sums["tokens"]),
                "train/forward_tokens": int(sums["forward_tokens"]),
            }, result, optimizer)
            if has_reference:
                record["train/kl"] = sums["kl"] / tok
                kl_values.append(sums["kl"] / tok)
            records.append(record)
            run.train_step += 1
        if stopped:
            break
    mean_kl = sum(kl_values) / len(kl_values) if kl_values else None
    return Update(records, stopped, planned - len(records) if stopped else 0, applied, trainer_lp, trained, mean_kl)
