"""Padding-free packing: the rows of a micro-batch packed into sequences, each row with its own positions.

A micro-batch of right-padded rows (batch, seq) costs rows x longest row tokens; packed, about
the rows' own tokens. The rows go through the model concatenated into sequences as long as the
longest row (``pack_bins``, first fit by decreasing length), whose ``position_ids`` restart at 0 at
each row, with no attention mask and no cache: transformers 5 then finds the rows from the positions
(``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal mask (sdpa,
eager) or runs varlen flash attention (flash_attention_2), so no row attends to another. Fewer
sequences of the padded width: the attention costs no more than the padded batch's, the rest
(projections, MLP, head) only the rows' own tokens. The per-token log-probs and entropies come back
in the padded layout, equal to the padded forward's up to float summation order
(``tests/training/test_packing.py``).

``response_log_probs_packed`` is the one call; ``use_packing`` decides, once per model, whether
a config's ``packing`` setting runs it (a model whose forward does not keep packed rows apart, found
by a two-row probe, is refused under ``true`` and falls back under ``auto``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BeforeValidator

from ..models.fused_head import log_probs_from_forward, response_log_probs, unwrap_model
from .config import ConfigError

# a config's ``packing``: YAML's true/false arrive as bools, the CLI's as text
PackingMode = Annotated[Literal["auto", "true", "false"],
                        BeforeValidator(lambda v: str(v).lower() if isinstance(v, bool) else v)]


def row_lengths(positions: torch.Tensor) -> torch.Tensor:
    """(batch,) the tokens each row must put through the model: up to its last scored position
    (``positions``, bool (batch, seq)); 0 for a row with none. Later tokens cannot change earlier
    positions' log-probs in a causal model, so they are left out."""
    seq = positions.shape[1]
    last = seq - positions.flip(1).to(torch.int8).argmax(1)
    return torch.where(positions.any(1), last, torch.zeros_like(last))


def pack_bins(lengths: list[int]) -> list[list[int]]:
    """Rows (indices into ``lengths``) in bins of at most ``max(lengths)`` tokens, first fit by
    decreasing length; rows of length 0 in none. Packing into the longest row's width, rather than
    into one sequence, keeps attention's cost that of the padded batch's rows (a block-diagonal mask
    over one long sequence is computed whole by sdpa) while the padding goes."""
    width = max(lengths, default=0)
    bins: list[list[int]] = []
    used: list[int] = []
    for r in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        if lengths[r] == 0:
            continue
        for b, u in enumerate(used):
            if u + lengths[r] <= width:
                bins[b].append(r)
                used[b] += lengths[r]
                break
        else:
            bins.append([r])
            used.append(lengths[r])
    return bins


def response_log_probs_packed(model, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                              return_token_entropy: bool = False, *, temperature: float = 1.0,
                              chunk_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """``fused_head.response_log_probs`` of right-padded ``input_ids``/``labels`` (batch, seq) at
    ``positions`` (bool, the labels' shape), computed on packed rows: each row's tokens up to its
    last position, concatenated into sequences as long as the longest row (``pack_bins``),
    ``position_ids`` 0..len-1 per row (a sequence's unused tail continues its last row, after it, so
    it changes nothing). Returns the same (batch, seq) ``log_probs`` (and ``token_entropy``), 0
    outside ``positions``; gradients flow."""
    batch, seq = labels.shape
    device = labels.device
    lengths = row_lengths(positions).tolist()
    bins = pack_bins(lengths)
    if not bins:  # nothing scored: the padded path's zeros
        zeros = torch.zeros(batch, seq, device=device)
        return {"log_probs": zeros, **({"token_entropy": zeros} if return_token_entropy else {})}
    width = max(lengths)
    src, dst = [], []
    position_ids = torch.zeros(len(bins), width, dtype=torch.long)
    for b, rows in enumerate(bins):
        offset = 0
        for r in rows:
            n = lengths[r]
            src.append(torch.arange(r * seq, r * seq + n))
            dst.append(torch.arange(b * width + offset, b * width + offset + n))
            position_ids[b, offset : offset + n] = torch.arange(n)
            offset += n
        position_ids[b, offset:] = torch.arange(n, n + width - offset)
    src, dst = torch.cat(src).to(device), torch.cat(dst).to(device)
    position_ids = position_ids.to(device)

    def packed(values: torch.Tensor, fill) -> torch.Tensor:
        flat = values.reshape(-1).index_select(0, src)
        return flat.new_full((len(bins) * width,), fill).index_copy(0, dst, flat).view(len(bins), width)

    ids, lab, pos = packed(input_ids, 0), packed(labels, 0), packed(positions, False)
    out = log_probs_from_forward(
        model, lab, lambda **extra: model(input_ids=ids, position_ids=position_ids, use_cache=False, **extra),
        return_token_entropy, temperature=temperature, chunk_tokens=chunk_tokens, positions=pos)
    result = {}
    for key, values in out.items():
        flat = values.reshape(-1).index_select(0, dst)
        result[key] = flat.new_zeros(batch * seq).index_copy(0, src, flat).view(batch, seq)
    return result


def micro_batch_log_probs(model, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                          packed: bool, return_token_entropy: bool = False, *, temperature: float = 1.0,
                          ) -> dict[str, torch.Tensor]:
    """A micro-batch's log-probs at ``positions``: packed (``response_log_probs_packed``) or padded
    (``fused_head.response_log_probs``), the same figures either way."""
    if packed:
        return response_log_probs_packed(model, input_ids, labels, positions, return_token_entropy,
                                         temperature=temperature)
    return response_log_probs(model, input_ids, labels, return_token_entropy, temperature=temperature,
                              positions=positions)


@torch.no_grad()
def packing_works(model) -> bool:
    """Whether ``model`` keeps packed rows apart, checked once per model on two short rows (eval
    mode): the second row's log-probs packed must be nearer its log-probs alone than a tenth of
    the distance of the same packed forward given a 2D attention mask of ones (rows attending
    across). A relative test, so bf16 weights' rounding passes and a forward that ignores
    ``position_ids`` (OPT, Bloom) does not."""
    inner = unwrap_model(model)
    known = getattr(inner, "_grpolab_packing_works", None)
    if known is not None:
        return known
    vocab = inner.get_input_embeddings().num_embeddings
    device = next(inner.parameters()).device
    first = torch.tensor([(7 * i + 3) % vocab for i in range(8)], device=device)
    second = torch.tensor([(5 * i + 11) % vocab for i in range(7)], device=device)
    ids = torch.cat([first[:-1], second[:-1]])[None]
    positions = torch.cat([torch.arange(7, device=device), torch.arange(6, device=device)])[None]
    was_training = inner.training
    inner.eval()
    try:
        def second_row(**kw):
            logits = inner(input_ids=ids, position_ids=positions, use_cache=False, **kw).logits[0, 7:].float()
            return torch.log_softmax(logits, -1).gather(1, second[1:, None])[:, 0]

        alone = torch.log_softmax(inner(input_ids=second[None, :-1], use_cache=False).logits[0].float(), -1)
        alone = alone.gather(1, second[1:, None])[:, 0]
        apart = (second_row() - alone).abs().max()
        across = (second_row(attention_mask=torch.ones_like(ids)) - alone).abs().max()
        works = bool(apart <= 0.1 * across)
    except (TypeError, ValueError, RuntimeError):  # a forward without position_ids, or refusing them
        works = False
    finally:
        inner.train(was_training)
    inner._grpolab_packing_works = works
    return works


def use_packing(model, mode: str, sharded: bool = False) -> bool:
    """Whether a ``packing`` setting (``auto``/``true``/``false``) packs ``model``'s micro-batches:
    ``false`` never; ``true`` where the model keeps packed rows apart (``packing_works``), else
    ``ConfigError`` in one line; ``auto`` where it does, with any attention: packed into bins of the
    longest row (``pack_bins``), a micro-batch runs fewer sequences of the padded width, so sdpa's
    block-diagonal mask costs no more than the padded rows' (docs/results/packing.md: 0.72x the padded
    update's time on the tiny model, fp32, 36 % of its tokens padding). Never under a sharded engine
    (the probe forward would be a collective some ranks skip)."""
    if mode == "false":
        return False
    if sharded:
        if mode == "true":
            raise ConfigError("packing: true: packed micro-batches are not supported under a sharded engine "
                              "(distributed: fsdp2/deepspeed); use packing: auto or false")
        return False
    if packing_works(model):
        return True
    if mode == "true":
        name = type(unwrap_model(model)).__name__
        raise ConfigError(f"packing: true: {name}'s forward lets packed rows attend to each other (its attention "
                          "ignores per-row position_ids); use packing: auto or false")
    return False
