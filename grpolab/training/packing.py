"""Padding-free packing: the rows of a micro-batch as one sequence, each with its own positions.

A micro-batch of right-padded rows (batch, seq) costs rows x longest row tokens; packed, it costs
the rows' own tokens. The rows go through the model as one (1, total) sequence whose
``position_ids`` restart at 0 at each row, with no attention mask and no cache: transformers 5
then finds the rows from the positions (``masking_utils.find_packed_sequence_indices``) and builds
a block-diagonal causal mask (sdpa, eager) or runs varlen flash attention (flash_attention_2), so
no row attends to another. The per-token log-probs and entropies come back in the padded layout,
equal to the padded forward's up to float summation order (``tests/training/test_packing.py``).

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


def response_log_probs_packed(model, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                              return_token_entropy: bool = False, *, temperature: float = 1.0,
                              chunk_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """``fused_head.response_log_probs`` of right-padded ``input_ids``/``labels`` (batch, seq) at
    ``positions`` (bool, the labels' shape), computed as one packed sequence: each row's tokens up
    to its last position, concatenated, ``position_ids`` 0..len-1 per row. Returns the same
    (batch, seq) ``log_probs`` (and ``token_entropy``), 0 outside ``positions``; gradients flow."""
    batch, seq = labels.shape
    device = labels.device
    lengths = row_lengths(positions)
    keep = torch.arange(seq, device=device)[None, :] < lengths[:, None]
    index = keep.reshape(-1).nonzero().squeeze(-1)
    if index.numel() == 0:  # nothing scored: the padded path's zeros
        zeros = torch.zeros(batch, seq, device=device)
        return {"log_probs": zeros, **({"token_entropy": zeros} if return_token_entropy else {})}
    ids = input_ids.reshape(-1).index_select(0, index)[None]
    lab = labels.reshape(-1).index_select(0, index)[None]
    pos = positions.reshape(-1).index_select(0, index)[None]
    position_ids = torch.arange(seq, device=device).expand(batch, seq).reshape(-1).index_select(0, index)[None]
    out = log_probs_from_forward(
        model, lab, lambda **extra: model(input_ids=ids, position_ids=position_ids, use_cache=False, **extra),
        return_token_entropy, temperature=temperature, chunk_tokens=chunk_tokens, positions=pos)
    result = {}
    for key, values in out.items():
        flat = values[0]
        result[key] = flat.new_zeros(batch * seq).index_copy(0, index, flat).view(batch, seq)
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


def varlen_attention(model) -> bool:
    """Whether ``model`` attends with a varlen kernel (flash attention), which skips the masked-out
    blocks of a packed sequence; sdpa and eager build a dense (total x total) block-diagonal mask."""
    impl = getattr(getattr(unwrap_model(model), "config", None), "_attn_implementation", None) or ""
    return impl.startswith("flash_attention")


def use_packing(model, mode: str, sharded: bool = False) -> bool:
    """Whether a ``packing`` setting (``auto``/``true``/``false``) packs ``model``'s micro-batches:
    ``false`` never; ``true`` where the model keeps packed rows apart (``packing_works``), else
    ``ConfigError`` in one line; ``auto`` where it does and attends with a varlen kernel
    (``varlen_attention``): with sdpa on the CPU the packed update measured 1.5x the padded one's
    time (docs/results/packing.md), its dense mask costing more than the padding it removes. Never
    under a sharded engine (the probe forward would be a collective some ranks skip)."""
    if mode == "false" or (mode == "auto" and not varlen_attention(model)):
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
