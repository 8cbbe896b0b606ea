"""Padding-free packing (training.packing): the packed forward gives the padded forward's per-token
log-probs, entropies and gradients, in GRPO's update too; a model whose attention cannot keep packed
rows apart is refused under packing: true.

The float32 bound: the two paths do the same arithmetic on differently shaped tensors (one (1, N)
sequence with a block-diagonal mask against (B, T) rows), so they differ only in summation order and
in the masked-out softmax terms (exactly 0 in both). A sum of K float32 terms reordered moves by at
most ~K * eps32 of the terms' magnitude; with K <= hidden size (128) per dot product, a few such
sums per layer and 5 layers, log-probs of magnitude <= log(vocab) ~ 5 move by at most
5 * 128 * eps32 * 5 * 4 ~ 1.5e-3 in the worst case and ~sqrt(K) of that typically: we allow
TOL = 1e-4 nats (1e-4 relative for gradients), while rows attending across rows (the mask removed)
differ by ~1e-2 or more."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

from grpolab.algorithms.grpo_update import accumulate_policy_gradient
from grpolab.core import normalize_group_rewards
from grpolab.models import build_tiny_model
from grpolab.models.fused_head import response_log_probs
from grpolab.rollout.base import Rollout
from grpolab.training.batching import make_rollout_batch
from grpolab.training.config import ConfigError
from grpolab.training.packing import packing_works, response_log_probs_packed, use_packing

EPS32 = torch.finfo(torch.float32).eps
TOL = 1e-4
assert 5 * 128 * EPS32 * 5 * 4 < 1e-2  # the worst-case bound above sits well below a cross-row difference


def skewed_rows(vocab: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input ids, labels, response mask) of rows of very different lengths (2 to 120 tokens)."""
    g = torch.Generator().manual_seed(1)
    lengths, prompt = [120, 2, 37, 5, 90], 4
    width = max(lengths) - 1
    ids, labels = torch.full((len(lengths), width), pad), torch.full((len(lengths), width), pad)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for r, n in enumerate(lengths):
        seq = torch.randint(5, vocab, (n,), generator=g)
        ids[r, : n - 1], labels[r, : n - 1] = seq[:-1], seq[1:]
        mask[r, min(prompt, n - 1) - 1 : n - 1] = True
    return ids, labels, mask


def grads(model) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_packed_log_probs_entropy_and_gradients_equal_padded():
    model = build_tiny_model("tiny", seed=0).train()
    ids, labels, mask = skewed_rows(model.config.vocab_size)
    weight = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    figures = {}
    for name, fn in [("padded", lambda: response_log_probs(model, ids, labels, True, positions=mask)),
                     ("packed", lambda: response_log_probs_packed(model, ids, labels, mask, True))]:
        model.zero_grad(set_to_none=True)
        out = fn()
        ((out["log_probs"] * weight * mask).sum() + (out["token_entropy"] * mask).sum()).backward()
        figures[name] = (out["log_probs"].detach(), out["token_entropy"].detach(), grads(model))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = figures["padded"], figures["packed"]
    assert float((lp_a - lp_b).abs().max()) < TOL
    assert float((ent_a - ent_b).abs().max()) < TOL
    assert not lp_b[~mask].any()  # 0 outside the scored positions, as the padded path
    assert g_a.keys() == g_b.keys()
    for k in g_a:
        assert float((g_a[k] - g_b[k]).abs().max()) <= TOL * max(1.0, float(g_a[k].abs().max())), k


def rollout_batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    rollouts = []
    for p, n_p in enumerate([6, 19]):
        prompt = torch.randint(5, vocab, (n_p,), generator=g).tolist()
        for n_r in [1, 40, 3, 25]:
            response = torch.randint(5, vocab, (n_r,), generator=g).tolist()
            rollouts.append(Rollout(prompt="", response="", prompt_ids=prompt, response_ids=response,
                                    logprobs=[0.0] * n_r, finish_reason="length", prompt_index=p))
    raw = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    return make_rollout_batch(rollouts, raw, normalize_group_rewards(raw, 4, 1e-6, True), 0)


def test_grpo_update_gradient_packed_equals_padded(grpo_config):
    model = build_tiny_model("tiny", seed=0).train()
    batch = rollout_batch(model.config.vocab_size)
    rows = list(range(8))
    out = {}
    for packing in ("false", "true"):
        cfg = grpo_config(rollout_batch_size=8, group_size=4, train_batch_size=8, gradient_accumulation_steps=2,
                          sampling_max_tokens=40, share_prompt_prefix=False, packing=packing)
        model.zero_grad(set_to_none=True)
        lp = torch.zeros(batch.labels.shape)
        sums = accumulate_policy_gradient(model, batch, rows, cfg, batch.response_mask.any(1), 0.0,
                                          torch.device("cpu"), contextlib.nullcontext, lp)
        out[packing] = (lp, grads(model), sums)
    (lp_a, g_a, s_a), (lp_b, g_b, s_b) = out["false"], out["true"]
    assert float((lp_a - lp_b).abs().max()) < TOL
    assert abs(s_a["loss"] - s_b["loss"]) < TOL
    for k in g_a:
        assert float((g_a[k] - g_b[k]).abs().max()) <= TOL * max(1.0, float(g_a[k].abs().max())), k


def test_packing_field_reads_yaml_bools(grpo_config):
    assert grpo_config(packing=True).packing == "true"
    assert grpo_config(packing=False).packing == "false"
    with pytest.raises(ValueError, match="packing"):
        grpo_config(packing="sometimes")


def test_model_without_packed_mask_is_refused_under_true_and_padded_under_auto():
    """OPT takes its positions from the attention mask, not position_ids: packed rows would attend to
    each other. The two-row probe finds it; the Llama-family embedded model passes it."""
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32))
    assert packing_works(build_tiny_model("tiny", seed=0)) is True
    assert packing_works(opt) is False
    assert use_packing(opt, "auto") is False and use_packing(opt, "false") is False
    with pytest.raises(ConfigError, match="packing: true: OPTForCausalLM's forward lets packed rows attend"):
        use_packing(opt, "true")


def test_rows_pack_into_bins_of_the_longest_row_and_auto_packs_an_sdpa_model():
    """First fit by decreasing length: every row of non-zero length in exactly one bin, no bin longer
    than the longest row, and fewer sequences than rows when rows are short against the longest (the
    point of packing); under auto an sdpa model that keeps rows apart is packed (bins cost no more
    attention than the padded rows)."""
    from grpolab.training.packing import pack_bins

    lengths = [30, 4, 12, 0, 17, 9, 30, 2, 21]
    bins = pack_bins(lengths)
    flat = sorted(r for b in bins for r in b)
    assert flat == [r for r, n in enumerate(lengths) if n > 0]
    assert all(sum(lengths[r] for r in b) <= max(lengths) for b in bins)
    assert len(bins) == 5  # 125 tokens in bins of 30: 5 at least, and first fit reaches it
    model = build_tiny_model("tiny", seed=0)
    assert model.config._attn_implementation == "sdpa"
    assert use_packing(model, "auto") is True
