"""Log-probs and entropies with real vocabularies: the logits are computed a chunk of positions at a
time (``core.logprobs``), with the values and gradients of the unchunked computation, in every path
that scores tokens (trainers, shared-prompt forward, old/reference log-probs, eval entropies, PPO),
through LoRA and engine wrappers; float32 logits under bf16 autocast (``models.precision``).

Memory is checked through measurable properties, not timings: the shapes of the logits blocks the
output head produces (a spy installed as the head's instance forward, where the chunked head and
``set_logits_fp32`` look for it), the tensors autograd saves, and the size of each forward."""

from __future__ import annotations

import copy
import re
import types
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import grpolab.core.logprobs as logprobs_mod
import grpolab.models.fused_head as fused_head
from grpolab.core import log_probs_from_logits
from grpolab.models import logits_fp32_enabled, set_logits_fp32
from grpolab.models.fused_head import output_head, response_log_probs

VOCAB = 8192
ROOT = Path(__file__).resolve().parents[2]


def llama(vocab=VOCAB, seed=0, dtype=torch.float32, **kw):
    """A random GQA Llama (6 query / 2 key-value heads, tied embeddings: SmolLM2's layout) with a
    large vocabulary."""
    cfg = dict(vocab_size=vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0,
               eos_token_id=1, bos_token_id=2)
    cfg.update(kw)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype).eval()


def batch(rows=3, length=13, vocab=VOCAB, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (rows, length), generator=g), torch.randint(3, vocab, (rows, length), generator=g)


def reference(model, ids, labels, temperature=1.0):
    """The unchunked computation: whole (B, L, V) logits, log-softmax, gather, entropy."""
    z = model(ids).logits / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def grads(model, lp, ent):
    model.zero_grad()
    (lp.sum() + 0.3 * ent.sum()).backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


class HeadSpy:
    """Records the shape of every logits block the output head computes (forward and backward
    recomputation), installed as the head's instance forward."""

    def __init__(self, head):
        self.head, self.shapes = head, []
        self.previous = head.__dict__.get("forward")
        inner = head.forward

        def spy(module, hidden, *a, **k):
            out = inner(hidden, *a, **k)
            self.shapes.append(tuple(out.shape))
            return out

        head.forward = types.MethodType(spy, head)

    def close(self):
        if self.previous is None:
            del self.head.forward
        else:
            self.head.forward = self.previous

    def rows(self):
        return [s[0] if len(s) == 2 else s[0] * s[1] for s in self.shapes]


# ---------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_and_gradients_equal_the_unchunked_ones_float64(temperature):
    model = llama(dtype=torch.float64)
    ids, labels = batch()
    ref_lp, ref_ent = reference(model, ids, labels, temperature)
    ref_g = grads(model, ref_lp, ref_ent)
    out = response_log_probs(model, ids, labels, True, temperature=temperature, chunk_tokens=5)
    assert torch.allclose(out["log_probs"], ref_lp, atol=1e-12, rtol=0)
    assert torch.allclose(out["token_entropy"], ref_ent, atol=1e-12, rtol=0)
    got = grads(model, out["log_probs"], out["token_entropy"])
    assert got.keys() == ref_g.keys()
    for name in ref_g:
        assert torch.allclose(got[name], ref_g[name], atol=1e-12, rtol=0), name


def test_chunked_gradients_equal_the_unchunked_ones_float32():
    model = llama()
    ids, labels = batch()
    one = response_log_probs(model, ids, labels, True, temperature=0.8, chunk_tokens=10**9)  # one chunk
    ref_g = grads(model, one["log_probs"], one["token_entropy"])
    out = response_log_probs(model, ids, labels, True, temperature=0.8, chunk_tokens=4)
    assert torch.allclose(out["log_probs"], one["log_probs"], atol=1e-5, rtol=0)
    got = grads(model, out["log_probs"], out["token_entropy"])
    scale = max(g.abs().max() for g in ref_g.values())
    for name in ref_g:
        assert (got[name] - ref_g[name]).abs().max() <= 1e-6 * scale, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_plain_head_takes_the_fused_path_with_the_unchunked_values_and_gradients(dtype, monkeypatch):
    """A plain float head is scored by ``_FusedHeadStats`` (its backward rebuilds each chunk's logits
    and turns them into their gradient in place): the values and gradients of the whole-logits
    computation, an entropy term in the loss included."""
    calls = []
    apply = fused_head._FusedHeadStats.apply
    monkeypatch.setattr(fused_head._FusedHeadStats, "apply", lambda *a: calls.append(1) or apply(*a))
    model = llama(dtype=dtype)
    ids, labels = batch()
    ref_lp, ref_ent = reference(model, ids, labels, 0.7)
    ref_g = grads(model, ref_lp, ref_ent)
    out = response_log_probs(model, ids, labels, True, temperature=0.7, chunk_tokens=5)
    assert calls == [1]
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert torch.allclose(out["log_probs"], ref_lp, atol=tol, rtol=0)
    assert torch.allclose(out["token_entropy"], ref_ent, atol=tol, rtol=0)
    got = grads(model, out["log_probs"], out["token_entropy"])
    assert got.keys() == ref_g.keys()
    scale = max(g.abs().max() for g in ref_g.values())
    for name in ref_g:
        assert (got[name] - ref_g[name]).abs().max() <= (1e-12 if dtype == torch.float64 else 1e-5) * scale, name


def test_fused_head_with_a_bias_passes_gradcheck():
    torch.manual_seed(3)
    head = torch.nn.Linear(6, 40, bias=True).double()
    hidden = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (9,))
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_head._FusedHeadStats.apply(h, w, b, labels, 0.6, 4, True),
        (hidden, head.weight, head.bias))


def test_hooked_or_wrapped_heads_keep_the_checkpointed_path():
    model = llama()
    head = output_head(model)
    assert fused_head._fusable(head, head.forward)
    handle = head.register_forward_hook(lambda *a: None)
    assert not fused_head._fusable(head, head.forward)
    handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 logits: the checkpointed path's upcasts apply
        assert not fused_head._fusable(head, head.forward)
    set_logits_fp32(model)  # an instance-level float32 forward
    assert not fused_head._fusable(head, head.forward)


def test_one_chunk_is_bit_identical_to_the_unchunked_formula():
    """With a small vocabulary everything fits one chunk: the same ops on the same numbers."""
    model = llama(vocab=300)
    ids, labels = batch(vocab=300)
    with torch.no_grad():
        z = model(ids).logits / 0.7
        lse = torch.logsumexp(z, -1)
        lp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
        ent = lse - (torch.exp(z - lse.unsqueeze(-1)) * z).sum(-1)
        out = response_log_probs(model, ids, labels, True, temperature=0.7)
    assert torch.equal(out["log_probs"], lp) and torch.equal(out["token_entropy"], ent)


def test_bf16_autocast_results_match_the_unchunked_computation():
    model = llama()
    ids, labels = batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_lp, ref_ent = log_probs_from_logits(model(ids).logits, labels, True)
        out = response_log_probs(model, ids, labels, True, chunk_tokens=6)
    assert out["log_probs"].dtype == torch.float32
    # the chunk's GEMM may round differently in bf16 from the whole batch's: bf16 tolerance
    assert torch.allclose(out["log_probs"], ref_lp, atol=0.1)
    assert torch.allclose(out["token_entropy"], ref_ent, atol=0.1)


# ---------------------------------------------------------------- bounded memory


def test_the_default_block_is_bounded_and_independent_of_rows():
    assert logprobs_mod.logits_chunk_tokens(49152) * 49152 * 4 <= logprobs_mod.LOGITS_CHUNK_BYTES
    assert logprobs_mod.logits_chunk_tokens(49152) >= 256  # big enough for an efficient matmul
    model = llama()
    spy = HeadSpy(model.lm_head)
    try:
        for rows in (2, 16):
            spy.shapes.clear()
            ids, labels = batch(rows=rows, length=20)
            with torch.no_grad():
                response_log_probs(model, ids, labels, True, chunk_tokens=7)
            assert spy.shapes and all(s == (7, VOCAB) for s in spy.shapes[:-1]), spy.shapes
            assert spy.shapes[-1][0] <= 7 and sum(spy.rows()) == rows * 20
    finally:
        spy.close()


def test_the_head_never_returns_whole_logits_and_the_backward_recomputes_chunks():
    model = llama()
    ids, labels = batch(rows=4, length=16)
    returned = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: returned.append(tuple(o.shape)))
    spy = HeadSpy(model.lm_head)
    try:
        out = response_log_probs(model, ids, labels, True, chunk_tokens=8)
        forward_blocks = list(spy.shapes)
        (out["log_probs"].sum() + out["token_entropy"].sum()).backward()
    finally:
        spy.close()
        hook.remove()
    assert returned == [(4, 16, 2)]  # log-prob and entropy per position, not (4, 16, V) logits
    assert forward_blocks == [(8, VOCAB)] * 8
    assert spy.shapes[8:] == [(8, VOCAB)] * 8  # the backward recomputes each chunk's logits, one at a time
    assert model.model.embed_tokens.weight.grad is not None


def test_autograd_keeps_no_logits_sized_tensor():
    """What the graph saves for the backward: with chunking, nothing of (positions x vocab) size."""
    model = llama()
    ids, labels = batch(rows=4, length=16)
    sizes = []

    params = {p.data_ptr() for p in model.parameters()}

    def pack(t):  # a saved parameter is a reference, not memory
        if t.data_ptr() not in params:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = response_log_probs(model, ids, labels, True, chunk_tokens=8)
    (out["log_probs"].sum() + out["token_entropy"].sum()).backward()
    assert max(sizes) < 8 * VOCAB <= 4 * 16 * VOCAB
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        reference(model, ids, labels)  # the unchunked computation keeps (B, L, V) tensors: the check can fail
    assert max(sizes) >= 4 * 16 * VOCAB


def test_eval_entropies_bound_every_forward_and_block(char_tokenizer):
    from grpolab.eval import token_entropies
    from grpolab.rollout import Rollout

    model = llama()
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout("p", "r", torch.randint(3, VOCAB, (5 + i % 4,), generator=g).tolist(),
                        torch.randint(3, VOCAB, (3 + i % 7,), generator=g).tolist(), [0.0] * (3 + i % 7), "stop")
                for i in range(64)]
    forward_tokens = []
    pre = model.register_forward_pre_hook(lambda m, args: forward_tokens.append(args[0].numel()))
    spy = HeadSpy(model.lm_head)
    old = logprobs_mod.LOGITS_CHUNK_BYTES
    logprobs_mod.LOGITS_CHUNK_BYTES = 4 * VOCAB * 16  # 16 positions per block
    try:
        got = token_entropies(model, rollouts, char_tokenizer, token_budget=64)
    finally:
        logprobs_mod.LOGITS_CHUNK_BYTES = old
        spy.close()
        pre.remove()
    assert len(forward_tokens) > 10 and max(forward_tokens) <= 64
    assert max(spy.rows()) <= 16 and all(s[-1] == VOCAB for s in spy.shapes)
    # the same entropies as one whole-batch, unchunked forward
    for i, r in enumerate(rollouts[:5]):
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            z = model(ids).logits[0, len(r.prompt_ids) - 1 : -1]
        h = -(torch.log_softmax(z, -1).exp() * torch.log_softmax(z, -1)).sum(-1).mean()
        assert got[i] == pytest.approx(float(h), abs=1e-5)


def test_old_log_probs_are_chunked_by_tokens_and_equal():
    from grpolab.rollout import Rollout
    from grpolab.training.batching import batched_log_probs, make_rollout_batch

    model = llama()
    g = torch.Generator().manual_seed(3)
    rollouts = [Rollout("p", "r", torch.randint(3, VOCAB, (4,), generator=g).tolist(),
                        torch.randint(3, VOCAB, (2 + i,), generator=g).tolist(), [0.0] * (2 + i), "stop",
                        prompt_index=i)
                for i in range(8)]
    rb = make_rollout_batch(rollouts, torch.zeros(8), torch.zeros(8), 0)
    forwards = []
    pre = model.register_forward_pre_hook(lambda m, args: forwards.append(tuple(args[0].shape)))
    try:
        lp = batched_log_probs(model, rb, 8, "cpu", lambda: torch.autocast("cpu", enabled=False), 1.0, token_budget=24)
    finally:
        pre.remove()
    assert len(forwards) > 1 and all(r * w <= 24 for r, w in forwards)
    with torch.no_grad():
        ref, _ = reference(model, rb.input_ids, rb.labels)
    assert torch.allclose(lp[rb.response_mask], ref[rb.response_mask], atol=1e-5)
    # the head ran on the response tokens only: no prompt or padding position through the (rows, vocab) block
    spy = HeadSpy(model.lm_head)
    try:
        batched_log_probs(model, rb, 8, "cpu", lambda: torch.autocast("cpu", enabled=False), 1.0)
    finally:
        spy.close()
    assert sum(spy.rows()) == int(rb.response_mask.sum()) == sum(2 + i for i in range(8))


# ---------------------------------------------------------------- every path that scores tokens


def test_shared_prefix_is_chunked_and_equals_the_plain_forward():
    from grpolab.models.shared_prefix import shared_prefix_response_log_probs

    model = llama(dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 6)]
    responses = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 3, 6, 2)]
    of_row = [0, 0, 1, 1]
    spy = HeadSpy(model.lm_head)
    try:
        out = shared_prefix_response_log_probs(model, prompts, responses, of_row, 0, "cpu", True, temperature=0.9,
                                               chunk_tokens=4)
    finally:
        spy.close()
    assert spy.shapes[0] == (2, 1, VOCAB)  # the prompt pass: one position per distinct prompt
    # the head at the response tokens only, padding skipped: (5-1) + (3-1) + (6-1) + (2-1) = 12 positions
    # after each row's first (from the prompt pass), 4 at a time, not 4 rows x 5 padded positions
    assert spy.shapes[1:] == [(4, VOCAB)] * 3
    mask = out["response_mask"]
    assert not out["log_probs"][~mask].any() and not out["token_entropy"][~mask].any()
    got = grads(model, out["log_probs"][mask], out["token_entropy"][mask])
    whole = shared_prefix_response_log_probs(model, prompts, responses, of_row, 0, "cpu", True, temperature=0.9,
                                             chunk_tokens=10**9)
    assert torch.allclose(out["log_probs"], whole["log_probs"], atol=1e-12)
    whole_g = grads(model, whole["log_probs"][mask], whole["token_entropy"][mask])
    for name in whole_g:
        assert torch.allclose(got[name], whole_g[name], atol=1e-12), name
    # and the plain per-sequence forward's values (the shared-prompt forward itself is exact to ~1e-7: its
    # rotary tables are float32)
    for row, (r, p) in enumerate(zip(responses, of_row)):
        ids = torch.tensor([prompts[p] + r])
        lp, ent = reference(model, ids[:, :-1], ids[:, 1:], 0.9)
        assert torch.allclose(out["log_probs"][row, : len(r)], lp[0, len(prompts[p]) - 1 :], atol=1e-6)
        assert torch.allclose(out["token_entropy"][row, : len(r)], ent[0, len(prompts[p]) - 1 :], atol=1e-6)


def test_grpo_micro_batch_gradient_is_the_same_with_chunked_logits():
    """The trainer's gradient (plain and shared-prompt micro-batches) with 3-position chunks equals
    the one-chunk gradient."""
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.algorithms.grpo_update import accumulate_policy_gradient
    from grpolab.rollout import Rollout
    from grpolab.training.batching import make_rollout_batch

    model = llama(dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (5,), generator=g).tolist() for _ in range(2)]
    rollouts = [Rollout("p", "r", prompts[i // 4], torch.randint(3, VOCAB, (2 + i % 5,), generator=g).tolist(),
                        [0.0] * (2 + i % 5), "stop", prompt_index=i // 4) for i in range(8)]
    adv = torch.randn(8, generator=g, dtype=torch.float64).float()
    rb = make_rollout_batch(rollouts, adv.abs(), adv, 0)
    contributes = torch.ones(8, dtype=torch.bool)
    for share in (False, True):
        cfg = GRPOConfig(rollout_batch_size=8, group_size=4, train_batch_size=8, gradient_accumulation_steps=2,
                         share_prompt_prefix=share, entropy_coef=0.01, loss_type="reinforce_with_baseline")
        results = []
        for chunk_bytes in (logprobs_mod.LOGITS_CHUNK_BYTES, 4 * VOCAB * 3):
            old = logprobs_mod.LOGITS_CHUNK_BYTES
            logprobs_mod.LOGITS_CHUNK_BYTES = chunk_bytes
            try:
                model.zero_grad()
                accumulate_policy_gradient(model, rb, list(range(8)), cfg, contributes, 0.0, "cpu",
                                           lambda: torch.autocast("cpu", enabled=False))
            finally:
                logprobs_mod.LOGITS_CHUNK_BYTES = old
            results.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for name in results[0]:
            assert torch.allclose(results[0][name], results[1][name], atol=1e-10), (share, name)


def test_lora_models_use_the_chunked_head_with_the_same_gradient():
    pytest.importorskip("peft")
    from grpolab.models import lora

    model = lora.apply_lora(llama(dtype=torch.float64), 4, 8.0)
    for name, p in model.named_parameters():  # B = 0 at init: move it so the adapter matters
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    assert output_head(model) is not None
    ids, labels = batch()
    ref_lp, ref_ent = reference(model, ids, labels, 0.9)
    ref_g = grads(model, ref_lp, ref_ent)
    spy = HeadSpy(output_head(model))
    try:
        out = response_log_probs(model, ids, labels, True, temperature=0.9, chunk_tokens=5)
    finally:
        spy.close()
    assert max(spy.rows()) == 5
    got = grads(model, out["log_probs"], out["token_entropy"])
    assert got.keys() == ref_g.keys() and all("lora_" in n for n in got)
    for name in ref_g:
        assert torch.allclose(got[name], ref_g[name], atol=1e-12), name
    # the reference policy of a LoRA run: the same model with its adapter disabled
    ref_model = lora.AdapterDisabled(model)
    assert output_head(ref_model) is output_head(model)
    with torch.no_grad():
        base = response_log_probs(ref_model, ids, labels, chunk_tokens=5)["log_probs"]
        with model.disable_adapter():
            plain = reference(model, ids, labels)[0]
    assert torch.allclose(base, plain, atol=1e-12) and not torch.allclose(base, ref_lp.detach(), atol=1e-3)


def test_ppo_value_head_reads_the_same_last_hidden_state():
    from grpolab.algorithms.ppo import PolicyWithValue

    model = llama()
    policy = PolicyWithValue(model, temperature=0.8)
    torch.nn.init.normal_(policy.value_head.proj.weight)
    ids, labels = batch()
    lp, ent, values = policy(ids, labels, return_entropy=True)
    out = model(ids, output_hidden_states=True)
    assert torch.allclose(values, policy.value_head(out.hidden_states[-1]), atol=1e-6)
    ref_lp, ref_ent = log_probs_from_logits(out.logits, labels, True, temperature=0.8)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)


def test_models_with_logits_after_the_head_fall_back_to_their_logits():
    """A model type not known to end with its head (or whose config rescales the logits) is scored
    from the logits its forward returns."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=500, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=5.0)).eval()
    assert output_head(model) is None
    ids, labels = batch(vocab=500)
    with torch.no_grad():
        out = response_log_probs(model, ids, labels, True, chunk_tokens=4)
        ref_lp, ref_ent = reference(model, ids, labels)
    assert torch.allclose(out["log_probs"], ref_lp, atol=1e-5)
    assert torch.allclose(out["token_entropy"], ref_ent, atol=1e-5)
    # positions: the same contract as the chunked head's, the figures there and 0 elsewhere
    positions = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    with torch.no_grad():
        some = response_log_probs(model, ids, labels, True, chunk_tokens=4, positions=positions)
    for key, ref in (("log_probs", ref_lp), ("token_entropy", ref_ent)):
        assert not some[key][~positions].any()
        assert torch.allclose(some[key][positions], ref[positions], atol=1e-5)
    softcapped = llama(vocab=500)
    softcapped.config.logit_scale = 0.5
    assert output_head(softcapped) is None and output_head(llama(vocab=500)) is not None


# ---------------------------------------------------------------- float32 logits under bf16 autocast


def test_set_logits_fp32_runs_the_head_in_float32_under_autocast():
    model = llama()
    ids, labels = batch()
    assert not logits_fp32_enabled(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(ids).logits
        set_logits_fp32(model)
        fp32 = model(ids).logits
        hidden = model.model(ids).last_hidden_state
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32 and logits_fp32_enabled(model)
    assert torch.allclose(fp32, hidden.float() @ model.lm_head.weight.T, atol=1e-5)
    # the chunked head computes each chunk through the float32 forward
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = response_log_probs(model, ids, labels, chunk_tokens=5)["log_probs"]
    assert torch.allclose(out, log_probs_from_logits(fp32, labels)[0], atol=1e-5)
    # copies (the sampler's replica, the frozen reference) keep it, bound to their own weights
    twin = copy.deepcopy(model)
    assert logits_fp32_enabled(twin) and twin.lm_head.forward.__self__ is twin.lm_head
    set_logits_fp32(model, on=False)
    assert not logits_fp32_enabled(model) and "forward" not in model.lm_head.__dict__
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(ids).logits.dtype == torch.bfloat16


def test_lean_decoder_logits_fp32_matches_the_hugging_face_forward():
    from grpolab.rollout import fast_decoder

    model = set_logits_fp32(llama())
    dec = fast_decoder.FastDecoder(model)
    assert dec.logits_fp32
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = dec.prefill(ids, mask, max_new=2)
        ref = [model(torch.tensor([row])).logits[0, -1] for row in ([5, 6, 7], [1, 2, 3, 4, 5])]
    assert first.dtype == torch.float32
    for row in range(2):
        assert ref[row].dtype == torch.float32
        assert torch.allclose(first[row], ref[row], atol=0.05)  # bf16 trunk, float32 head


def test_lean_decoder_uses_layers_already_in_the_autocast_dtype_without_copying_them():
    """A bf16 LoRA run's sampler copy holds its merged layers in bf16 beside an fp32 trunk: under bf16
    autocast the lean decoder reads those weights where they are (the cast block holds only the fp32
    ones) and its logits equal an all-fp32 copy's, whose weights autocast casts to the same values."""
    from grpolab.rollout import fast_decoder

    model = llama(tie_word_embeddings=False)
    mixed = copy.deepcopy(model)
    layer = mixed.model.layers[0]
    for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
        lin.to(torch.bfloat16)
    ids, mask = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    dec_ref, dec = fast_decoder.FastDecoder(model), fast_decoder.FastDecoder(mixed)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = dec_ref.prefill(ids, mask, max_new=2), dec.prefill(ids, mask, max_new=2)
        layers, _ = dec._weights(torch.bfloat16)
    assert layers[0].o_w is layer.self_attn.o_proj.weight and layers[0].down_w is layer.mlp.down_proj.weight
    assert layers[0].qkv_w.dtype == torch.bfloat16 and layers[0].qkv_w is not dec.layers[0].qkv_w
    assert torch.equal(got, ref)


def test_logits_fp32_shrinks_the_sampler_trainer_mismatch_under_bf16():
    from grpolab.core import build_sequences
    from grpolab.models import build_char_tokenizer
    from grpolab.rollout import HFRolloutBackend, SamplingParams

    tok = build_char_tokenizer()
    model = llama(vocab=len(tok), hidden_size=96, num_hidden_layers=2, tie_word_embeddings=False)
    with torch.no_grad():  # logits of realistic size (~10), where bf16 rounding is coarse
        model.lm_head.weight.mul_(20)

    def mismatch(dtype=torch.bfloat16):
        backend = HFRolloutBackend(model, tok, autocast_dtype=dtype)
        out = backend.generate(["Q: 1+2", "Hello there", "abc"], 4, SamplingParams(max_tokens=12, seed=0))
        seq = build_sequences([r.prompt_ids for r in out], [r.response_ids for r in out], 0)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            lp = response_log_probs(model, seq["input_ids"], seq["labels"])["log_probs"]
        sampler = torch.zeros_like(lp)
        for i, r in enumerate(out):
            sampler[i, len(r.prompt_ids) - 1 : len(r.prompt_ids) - 1 + len(r.logprobs)] = torch.tensor(r.logprobs)
        return float((lp - sampler).abs()[seq["response_mask"]].mean())

    # the float32 model's gap: two float32 computations of the same log-probs (the rounding floor)
    float32_gap, before = mismatch(None), mismatch()
    set_logits_fp32(model)
    after = mismatch()
    # Where the sampler and the trainer round the bf16 computation differently (AVX2's and
    # AVX-512's bf16 kernels), the float32 head removes the head's part: at least half of the gap
    # with these large logits. Where they compute it identically (ATen's default kernels), the
    # bf16 gap is already at the float32 floor and there is nothing to remove; never worse.
    assert after <= before + 4 * float32_gap, (before, after, float32_gap)
    if before > 4 * float32_gap:
        assert after < before / 2, (before, after, float32_gap)


# ---------------------------------------------------------------- engines: DDP and FSDP2 with chunks

CHUNKED_GRAD_CHECK = """
import atexit, runpy, sys
import grpolab.core.logprobs as lp
import grpolab.models.fused_head as fh
lp.LOGITS_CHUNK_BYTES = {chunk_bytes}  # 3 positions of the embedded model's vocabulary per block
calls = [0]
plain = lp.checkpoint

def counted(*args, **kwargs):
    calls[0] += 1
    return plain(*args, **kwargs)

lp.checkpoint = counted
fused_plain = fh._FusedHeadStats.apply

def fused(hidden, weight, bias, labels, temperature, step, entropy):  # a plain float head: its chunks
    calls[0] += -(-hidden.shape[0] // step)
    return fused_plain(hidden, weight, bias, labels, temperature, step, entropy)

fh._FusedHeadStats.apply = fused
atexit.register(lambda: print("CHUNKED_BLOCKS", calls[0], flush=True))
sys.argv = ["distributed_grad_check.py"]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_distributed_gradients_with_chunked_logits(tmp_path):
    """tests/helpers/distributed_grad_check.py (DDP and FSDP2, 2 ranks, every loss and normalisation) with
    3-position logits blocks: every micro-batch's head runs chunked."""
    from grpolab.models import load_model_and_tokenizer
    from tests.helpers.torchrun import json_rows, torchrun

    vocab = load_model_and_tokenizer("embedded:tiny")[0].config.vocab_size
    script = tmp_path / "chunked_grad_check.py"
    script.write_text(CHUNKED_GRAD_CHECK.format(chunk_bytes=4 * vocab * 3,
                                                script=str(ROOT / "tests" / "helpers" / "distributed_grad_check.py")))
    out = torchrun([str(script)], timeout=400)
    rows = json_rows(out.stdout)
    assert rows
    for row in rows:
        assert row["scale"] > 1e-3 and row["max_abs_diff"] <= 1e-6, row
    # two ranks print at once: a rank's line can be glued to the other's, so find the figures anywhere
    counts = [int(n) for n in re.findall(r"CHUNKED_BLOCKS\s*(\d+)", out.stdout)]
    assert counts and min(counts) > 100, counts  # every rank's forwards ran chunked


def test_logits_fp32_in_a_bf16_grpo_run_reaches_the_sampler_and_the_trainer(grpo_config, tmp_path, monkeypatch):
    """``logits_fp32: true`` reaches the trainer and the sampler alike (the Run sets it on the model
    before the sampler's and the reference's copies are made): every lean decoder the run builds
    computes its head in float32, the trainer's head runs the float32 forward, and the sampler/trainer
    log-prob gap is still measured on every sampled token. Its size is not compared with the bf16
    head's here: rounding the logits to bf16 can hide the trunk's differences that a float32 head
    shows (ATen's default kernels: 3e-8 with the bf16 head, 6e-5 with the float32 one, where a
    shorter row's padding changes the trainer's bf16 trunk), and those depend on the CPU's kernels;
    the synthetic test above compares the two heads on the same tokens."""
    from grpolab.algorithms.grpo import train_grpo
    from grpolab.models import precision
    from grpolab.rollout import fast_decoder
    from grpolab.training.metric_logging import read_metrics

    decoders, head_calls = [], []
    init, fp32_forward = fast_decoder.FastDecoder.__init__, precision._fp32_head_forward

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        decoders.append(self.logits_fp32)

    def counting_forward(self, hidden, *args, **kwargs):
        head_calls.append(tuple(hidden.shape))
        return fp32_forward(self, hidden, *args, **kwargs)

    monkeypatch.setattr(fast_decoder.FastDecoder, "__init__", recording_init)
    monkeypatch.setattr(precision, "_fp32_head_forward", counting_forward)

    def mismatch(**kw):
        decoders.clear(), head_calls.clear()
        cfg = grpo_config(n_grpo_steps=2, train_batch_size=8, gradient_accumulation_steps=2, eval_examples=1,
                          log_generations_samples=0, reward="tests.helpers.reward_fixtures:length_parity",
                          run_dir=str(tmp_path / str(kw)), **{"dtype": "bfloat16", **kw})
        steps = [r for r in read_metrics(train_grpo(cfg).metrics_path) if "health/logprob_mismatch" in r]
        assert len(steps) == 2 and all(r["health/logprob_mismatch_tokens"] > 0 for r in steps)

    mismatch()
    assert decoders and not any(decoders) and not head_calls  # the bf16 head: neither side in float32
    mismatch(logits_fp32=True)
    assert decoders and all(decoders), decoders  # the sampler: every decoder it built
    assert head_calls  # the trainer's log-probs (and the reference's) went through the float32 head
