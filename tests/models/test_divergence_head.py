"""``models.fused_head.response_divergence`` against the plain computation: each model's whole
logits from its forward, gathered at the masked positions, and the registered divergence of those.

The models are built here, tiny and seeded: Llamas (a chunkable head) and GPT-2s (``output_head`` is
None: the fallback that takes the logits from the forward; the embedded tiny model is a Llama, so it
has a head). Both ways run in float64 and differ only in the order of their sums, so they agree to
~1e-10 of the largest value; a float32 run is checked against the float64 reference within a float32
bound. ``chunk_tokens=3`` spreads the ~16 masked positions over several chunks, and the memory test
checks, chunk by chunk, that no wider logits block than that ever exists."""

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from grpolab.core import get_divergence, get_response_log_probs
from grpolab.models.fused_head import output_head, response_divergence

VOCAB, CHUNK = 300, 3
EPS32 = torch.finfo(torch.float32).eps


def llama(seed, vocab=VOCAB):
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def gpt2(seed, vocab=VOCAB):
    config = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


BUILD = {"llama": llama, "gpt2": gpt2}


def batch(seed=0):
    """ids and labels (3, 8); the mask is a ragged batch of responses (prompt and padding False)."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, VOCAB, (3, 8), generator=g), torch.randint(0, VOCAB, (3, 8), generator=g)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 1:8], mask[1, 3:6], mask[2, 2:8] = True, True, True
    return ids, labels, mask


def reference(student, teacher, ids, labels, mask, name, beta, temperature):
    """The whole logits of both models, then the divergence at the masked positions."""
    s_logits = student(ids).logits
    with torch.no_grad():
        t_logits = teacher(ids).logits
    log_probs = torch.log_softmax(s_logits / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
    return {"divergence": get_divergence(name)(s_logits[mask], t_logits[mask], temperature=temperature, beta=beta),
            "student_log_probs": log_probs}


def run(fn, student, teacher, name, beta, temperature, **kw):
    """Outputs of ``fn`` and the student's parameter gradients of ``sum(w * divergence) + 0.1 *
    sum(masked student log-probs)`` (random w: each position's gradient counts on its own)."""
    ids, labels, mask = batch()
    student.zero_grad(set_to_none=True)
    teacher.zero_grad(set_to_none=True)
    out = fn(student, teacher, ids, labels, mask, name, beta=beta, temperature=temperature, **kw)
    w = torch.randn(int(mask.sum()), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss = (w.to(out["divergence"].dtype) * out["divergence"]).sum() + 0.1 * out["student_log_probs"][mask].sum()
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters()), "a gradient reached the teacher"
    grads = {n: p.grad.double().clone() for n, p in student.named_parameters() if p.grad is not None}
    return {k: v.detach().double() for k, v in out.items()}, grads


def ours(student, teacher, ids, labels, mask, name, **kw):
    return response_divergence(student, teacher, ids, labels, mask, name, chunk_tokens=CHUNK, **kw)


CASES = [("llama", "llama", "forward_kl", 0.5, 1.0), ("llama", "llama", "reverse_kl", 0.5, 0.7),
         ("llama", "llama", "generalized_jsd", 0.3, 1.3), ("llama", "llama", "generalized_jsd", 0.0, 1.0),
         ("gpt2", "gpt2", "generalized_jsd", 0.5, 0.7), ("llama", "gpt2", "reverse_kl", 0.5, 1.0),
         ("gpt2", "llama", "generalized_jsd", 0.3, 1.0)]


@pytest.mark.parametrize("s_kind,t_kind,name,beta,temperature", CASES)
def test_values_and_student_gradients_equal_the_whole_logits_in_float64(s_kind, t_kind, name, beta, temperature):
    student, teacher = BUILD[s_kind](0).double(), BUILD[t_kind](1).double().eval()
    assert (output_head(student) is None) == (s_kind == "gpt2") and (output_head(teacher) is None) == (t_kind == "gpt2")
    got, g_got = run(ours, student, teacher, name, beta, temperature)
    want, g_want = run(reference, student, teacher, name, beta, temperature)
    assert got["divergence"].shape == (int(batch()[2].sum()),) and (got["divergence"] > 0).all()
    assert not teacher.training and student.training, "modes changed"
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12, msg=key)
    ids, labels, _ = batch()
    with torch.no_grad():
        t_ref = get_response_log_probs(teacher, ids, labels, temperature=temperature)["log_probs"]
    torch.testing.assert_close(got["teacher_log_probs"], t_ref.double(), rtol=1e-10, atol=1e-12)
    assert g_got.keys() == g_want.keys() and len(g_got) == len(list(student.parameters()))
    for n in g_want:
        scale = g_want[n].abs().max()
        torch.testing.assert_close(g_got[n], g_want[n], rtol=0, atol=1e-10 * scale, msg=n)


def test_float32_agrees_with_the_float64_reference_within_a_float32_bound():
    """Bound: eps32 times (V + H), the terms a logit and its log-sum-exp sum (the n*u bound), times 8
    for the two layers and the divergence, of each tensor's largest value. (Measured: the values
    ~10x inside it — a divergence of near-uniform random models is a cancellation — the gradients
    ~500x.)"""
    student, teacher = llama(0), llama(1).eval()
    got, g_got = run(ours, student, teacher, "generalized_jsd", 0.3, 0.7)
    want, g_want = run(reference, copy.deepcopy(student).double(), copy.deepcopy(teacher).double(),
                       "generalized_jsd", 0.3, 0.7)
    factor = 8 * (VOCAB + student.config.hidden_size) * EPS32
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=factor * want[key].abs().max(), msg=key)
    for n in g_want:
        torch.testing.assert_close(g_got[n], g_want[n], rtol=0, atol=factor * g_want[n].abs().max(), msg=n)


@pytest.mark.parametrize("build", [llama, gpt2])
def test_vocabulary_sizes_must_match(build):
    ids, labels, mask = batch()
    with pytest.raises(ValueError, match=f"^student and teacher vocabularies differ: student {VOCAB}, teacher 301$"):
        response_divergence(build(0), build(1, vocab=301), ids, labels, mask, "forward_kl")


def test_bad_arguments_are_refused():
    ids, labels, mask = batch()
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        response_divergence(llama(0), llama(1), ids, labels, mask, "kl")
    with pytest.raises(ValueError, match="mask must be bool"):
        response_divergence(llama(0), llama(1), ids, labels, mask.long(), "forward_kl")
    with pytest.raises(ValueError, match="beta must be in"):
        response_divergence(llama(0), llama(1), ids, labels, mask, "generalized_jsd", beta=2.0)


class VocabWide(TorchDispatchMode):
    """Records the rows (numel // V) of every tensor whose last dimension is the vocabulary that any
    op of the forward or the backward allocates (views allocate nothing and are skipped: a view of
    whole logits would have been counted where they were made)."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not func.is_view and isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB:
                self.rows.append(t.numel() // VOCAB)
        return out


def test_no_logits_wider_than_a_chunk_exist_and_one_chunk_is_kept_at_a_time():
    """Every vocabulary-wide tensor of the forward and backward has at most ``chunk_tokens`` rows,
    and what autograd keeps for the backward holds none (each chunk is checkpointed and rebuilt in
    the backward). The plain reference, checked the same way, fails both."""
    student, teacher = llama(0), llama(1).eval()
    params = list(student.parameters()) + list(teacher.parameters())
    ids, labels, mask = batch()

    def measure(fn):
        kept: list[int] = []

        def pack(t):
            if t.dim() and t.shape[-1] == VOCAB and t.untyped_storage().data_ptr() not in storages:
                kept.append(t.numel() // VOCAB)
            return t

        storages = {p.untyped_storage().data_ptr() for p in params}
        with VocabWide() as wide, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(student, teacher, ids, labels, mask, "generalized_jsd", beta=0.5, temperature=1.0)
            (out["divergence"].sum() + out["student_log_probs"][mask].sum()).backward()
        return wide.rows, kept

    rows, kept = measure(ours)
    assert rows and max(rows) <= CHUNK, f"a vocabulary-wide tensor of {max(rows)} rows (chunk {CHUNK})"
    assert sum(kept) == 0, f"{sum(kept)} rows of logits kept for the backward"
    rows, kept = measure(reference)
    assert max(rows) == ids.numel() and sum(kept) >= int(mask.sum())


def test_the_teacher_runs_without_gradients_and_nothing_flows_without_them():
    student, teacher = llama(0), llama(1)
    ids, labels, mask = batch()
    out = response_divergence(student, teacher, ids, labels, mask, "reverse_kl", chunk_tokens=CHUNK)
    assert out["divergence"].requires_grad and not out["teacher_log_probs"].requires_grad
    with torch.no_grad():
        out = response_divergence(student, teacher, ids, labels, mask, "reverse_kl", chunk_tokens=CHUNK)
    assert not out["divergence"].requires_grad and math.isfinite(out["divergence"].sum())


def test_an_empty_mask_gives_no_values():
    student, teacher = llama(0), llama(1)
    ids, labels, mask = batch()
    out = response_divergence(student, teacher, ids, labels, torch.zeros_like(mask), "forward_kl", chunk_tokens=CHUNK)
    assert out["divergence"].shape == (0,) and out["student_log_probs"].shape == ids.shape
