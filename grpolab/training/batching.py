"""How rows become optimizer batches and micro-batches: the seeded example sampler, micro-batch
planning (fixed CS336 slices or packing by a token budget), row selection with padding trimmed,
and the per-epoch shuffle of off-policy optimizer batches. One path for every trainer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import build_sequences, pack_rows, sft_microbatch_train_step
from ..envs import loss_mask_tensor
from ..models.fused_head import response_log_probs
from . import distributed


def plan_microbatches(
    lengths: list[int], gradient_accumulation_steps: int, token_budget: int | None = None
) -> list[list[int]]:
    """Split row indices into micro-batches.

    Without a budget: ``gradient_accumulation_steps`` consecutive slices, equal when the rows
    divide evenly (CS336), else differing by at most one row (losses scaled by global sizes). With a
    ``token_budget``: rows sorted by length and packed so each micro-batch's padded size
    (rows x longest row) stays within the budget — less padding, fewer passes. The losses must
    then be scaled by the global batch size (``global_batch_size=``), which keeps the gradient
    equal to the fixed-micro-batch gradient.
    """
    n = len(lengths)
    if token_budget is None:
        size, extra = divmod(n, gradient_accumulation_steps)
        bounds = [i * size + min(i, extra) for i in range(gradient_accumulation_steps + 1)]
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:]) if b > a]
    order = sorted(range(n), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        candidate = max(longest, lengths[i])
        if current and candidate * (len(current) + 1) > token_budget:
            batches.append(current)
            current, candidate = [], lengths[i]
        current.append(i)
        longest = candidate
    if current:
        batches.append(current)
    return batches


def take_rows(batch: dict[str, torch.Tensor], rows: list[int], device) -> dict[str, torch.Tensor]:
    """Select rows of right-padded (B, T) tensors and trim the common padding on the right."""
    index = torch.tensor(rows, dtype=torch.long)
    mask = batch["response_mask"][index]
    # the last position any selected row uses: its last response token
    used = mask.any(0).nonzero()
    width = int(used.max()) + 1 if len(used) else 1
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == mask.shape[1]:
            out[k] = v[index, :width].to(device)
        elif isinstance(v, torch.Tensor):
            out[k] = v[index].to(device)
    return out


def optimizer_batch_count(n_rows: int, batch_size: int) -> int:
    """How many optimizer batches ``optimizer_batches`` makes of ``n_rows`` rows per epoch."""
    return -(-n_rows // max(1, batch_size // distributed.current().world_size))


def optimizer_batches(n_rows: int, batch_size: int, shuffle: bool, generator: torch.Generator | None = None,
                      keep_together: list[int] | None = None) -> list[list[int]]:
    """Row indices of each optimizer batch for one epoch over ``n_rows`` rows.

    ``shuffle``: a fresh permutation per call (off-policy epochs see different batches each
    epoch, as veRL and OpenRLHF do). Within a batch, rows are then ordered by ``keep_together``
    (e.g. each row's prompt index) so rows sharing a prompt stay adjacent for prompt sharing;
    the order inside a batch does not change its gradient.

    ``batch_size`` is the global optimizer batch: in a distributed run each rank holds its share of
    the rollout batch, so its optimizer batches have ``batch_size / world_size`` rows."""
    batch_size = max(1, batch_size // distributed.current().world_size)
    order = torch.randperm(n_rows, generator=generator).tolist() if shuffle else list(range(n_rows))
    batches = [order[i : i + batch_size] for i in range(0, n_rows, batch_size)]
    if shuffle and keep_together is not None:
        batches = [sorted(b, key=lambda r: (keep_together[r], r)) for b in batches]
    return batches


class ExampleSampler:
    """Seeded pass-by-pass shuffling of a dataset, with a resumable position."""

    def __init__(self, n: int, seed: int):
        if n == 0:
            raise ValueError("the training set is empty")
        self.n, self.seed = n, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            take = min(k - len(out), self.n - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()


@dataclass
class RolloutBatch:
    """One rollout batch: the exact sampled ids (right-padded, shifted) and what the update needs.
    Per-token tensors are (batch, seq) in label positions; per-row ones are (batch,)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    raw_rewards: torch.Tensor
    advantages: torch.Tensor
    sampler_log_probs: torch.Tensor
    sequences: list[tuple[list[int], list[int], int]]  # (prompt ids, response ids, prompt index) per row
    pad_id: int
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # sampler/trainer importance-sampling correction, per token
    # the trainer's log-probs of every sampled token before the update, where they were computed
    # (off-policy, or for the IS correction): what the sampler/trainer mismatch is measured on
    pre_update_log_probs: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors ``take_rows`` slices: per-token ones and per-row ones as (batch, 1)."""
        out = {"input_ids": self.input_ids, "labels": self.labels, "response_mask": self.response_mask,
               "raw_rewards": self.raw_rewards.unsqueeze(1), "advantages": self.advantages.unsqueeze(1)}
        for key in ("old_log_probs", "ref_log_probs", "is_weights"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def make_rollout_batch(rollouts, raw_rewards: torch.Tensor, advantages: torch.Tensor, pad_id: int) -> RolloutBatch:
    """The rollouts as tensors. ``response_mask`` is the loss mask: response positions, minus the
    observation tokens of multi-turn rollouts (``Rollout.loss_mask``), so those leave every loss,
    length normaliser, KL, entropy and IS figure while still being fed to the model as context."""
    seqs = build_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad_id)
    sampler_lp = torch.zeros(seqs["labels"].shape)
    mask = seqs["response_mask"]
    for i, r in enumerate(rollouts):
        start = len(r.prompt_ids) - 1
        sampler_lp[i, start : start + len(r.logprobs)] = torch.tensor(r.logprobs)
        if r.loss_mask is not None:
            mask[i, start : start + len(r.loss_mask)] &= torch.tensor(r.loss_mask, dtype=torch.bool)
    return RolloutBatch(seqs["input_ids"], seqs["labels"], mask, raw_rewards, advantages, sampler_lp,
                        [(r.prompt_ids, r.response_ids, r.prompt_index) for r in rollouts], pad_id)


@torch.no_grad()  # not inference_mode: FSDP2's all-gather buffers made in it could not be written again
def batched_log_probs(model, batch: RolloutBatch, rows_per_pass: int, device, autocast, temperature: float,
                      token_budget: int | None = None, only: list[int] | None = None,
                      fill: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs of every row of a rollout batch without gradients (old policy, reference).

    At most ``rows_per_pass`` rows per forward, and (in one process or under DDP) at most
    ``token_budget`` padded tokens (default ``core.logprobs.INFERENCE_TOKEN_BUDGET``); the logits
    themselves are chunked by ``response_log_probs``. Under FSDP2/ZeRO-3 a forward is a
    collective, so every rank keeps the same fixed slices of ``rows_per_pass`` rows. ``only``: just
    those rows (one process or DDP), the others copied from ``fill``. Zeros outside the response mask
    (a chunkable head, ``fused_head.output_head``, runs on the response tokens only)."""
    tensors = batch.tensors()
    out = torch.zeros(batch.labels.shape) if fill is None else fill.clone()
    lengths = [len(p) + len(r) - 1 for p, r, _ in batch.sequences]
    every = list(range(len(batch.sequences))) if only is None or distributed.current().sharded else list(only)
    for start in range(0, len(every), rows_per_pass):
        rows = every[start : start + rows_per_pass]
        groups = [rows] if distributed.current().sharded else [
            [rows[i] for i in group] for group in pack_rows([lengths[r] for r in rows], token_budget)]
        for group in groups:
            mb = take_rows(tensors, group, device)
            with autocast():
                lp = response_log_probs(model, mb["input_ids"], mb["labels"], temperature=temperature,
                                        positions=mb["response_mask"].bool())["log_probs"]
            out[group, : lp.shape[1]] = lp.float().cpu()
    return out


def accumulate_sft_gradient(model, sequences: list[tuple], gradient_accumulation_steps: int,
                            normalize_constant: float, pad_id: int, device, autocast) -> tuple[float, float, float]:
    """Forward/backward one optimizer batch of (prompt ids, response ids[, loss mask]) in equal
    micro-batches, loss on the response tokens only (those the mask keeps). Returns (loss, summed
    token NLL, response tokens).

    In a distributed run ``sequences`` is this rank's equal share of the optimizer batch: each
    rank's loss is ``world_size`` times its part and the engine averages, so the gradient is the
    single-process one; the returned figures are totals over ranks."""
    total_loss, total_nll, total_tok = 0.0, 0.0, 0.0
    plans = plan_microbatches([len(s[0]) + len(s[1]) for s in sequences], gradient_accumulation_steps)
    padding = distributed.padding_micro_batches(len(plans))
    for plan in plans:
        chunk = [sequences[i] for i in plan]
        batch = build_sequences([s[0] for s in chunk], [s[1] for s in chunk], pad_id)
        masks = [s[2] if len(s) > 2 else None for s in chunk]
        if any(m is not None for m in masks):  # tool-using demonstrations: observations leave the loss
            batch["response_mask"] &= loss_mask_tensor([len(s[0]) for s in chunk], masks, batch["labels"].shape)
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            out = response_log_probs(model, batch["input_ids"], batch["labels"])
        loss, meta = sft_microbatch_train_step(out["log_probs"].float(), batch["response_mask"],
                                               gradient_accumulation_steps, normalize_constant)
        n_tok = float(meta["num_response_tokens"])
        total_loss += float(loss)
        total_nll += float(meta["token_nll"]) * n_tok
        total_tok += n_tok
    for _ in range(padding):
        distributed.dummy_backward(model)
    world = distributed.current().world_size
    return (distributed.all_reduce(total_loss) / world, distributed.all_reduce(total_nll),
            distributed.all_reduce(total_tok))
