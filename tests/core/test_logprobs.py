"""grpolab.core.logprobs: entropy, (tempered) log-probs, tokenisation."""

import math

import pytest
import torch

from grpolab.core import (
    compute_entropy,
    get_response_log_probs,
    log_probs_from_logits,
    pack_rows,
    tokenize_prompt_and_output,
)
from grpolab.models import sum_response_log_probs


def test_compute_entropy_hand_cases():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]]])
    h = compute_entropy(logits)
    assert h.shape == (1, 2)
    assert h[0, 0].item() == pytest.approx(math.log(4))
    assert h[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    p = torch.tensor([0.5, 0.25, 0.25])
    assert compute_entropy(p.log()).item() == pytest.approx(-(p * p.log()).sum().item())
    big = compute_entropy(torch.tensor([[1e4, 1e4 - 1.0]]))
    assert torch.isfinite(big).all()


class _TableLM(torch.nn.Module):
    """A causal 'LM' whose logits depend only on the current token: enough to test plumbing."""

    def __init__(self, vocab=7, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g))

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_get_response_log_probs_matches_log_softmax_and_keeps_grad():
    lm = _TableLM()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    labels = torch.tensor([[2, 3, 0], [5, 6, 1]])
    out = get_response_log_probs(lm, ids, labels, return_token_entropy=True)
    assert set(out) == {"log_probs", "token_entropy"}
    ref = torch.log_softmax(lm.table[ids], -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(out["log_probs"], ref, atol=1e-6)
    assert torch.allclose(out["token_entropy"], compute_entropy(lm.table[ids]), atol=1e-6)
    out["log_probs"].sum().backward()
    assert lm.table.grad is not None
    assert set(get_response_log_probs(lm, ids, labels)) == {"log_probs"}


def test_sum_response_log_probs_matches_a_manual_sum(char_tokenizer):
    lm = _TableLM(vocab=len(char_tokenizer))
    sums, counts = sum_response_log_probs(lm, char_tokenizer, ["ab", "c"], ["cd", "abba"])
    batch = tokenize_prompt_and_output(["ab", "c"], ["cd", "abba"], char_tokenizer)
    lp = get_response_log_probs(lm, batch["input_ids"], batch["labels"])["log_probs"]
    assert counts.tolist() == [2, 4]
    assert torch.allclose(sums, (lp * batch["response_mask"]).sum(-1))


def test_tokenize_prompt_and_output(char_tokenizer):
    out = tokenize_prompt_and_output(["ab", "c"], ["cd", "abba"], char_tokenizer)
    assert set(out) == {"input_ids", "labels", "response_mask"}
    enc = lambda s: char_tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    pad = char_tokenizer.pad_token_id
    full0 = enc("ab") + enc("cd") + [pad]
    full1 = enc("c") + enc("abba")
    assert out["input_ids"].tolist() == [full0[:-1], full1[:-1]]
    assert out["labels"].tolist() == [full0[1:], full1[1:]]
    assert out["response_mask"].tolist() == [[False, True, True, False], [True, True, True, True]]
    assert out["response_mask"].dtype == torch.bool


def test_entropy_gradcheck():
    torch.manual_seed(0)
    assert torch.autograd.gradcheck(compute_entropy, (torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True),))


# ---------------------------------------------------------------- temperature
def _tempered_reference(logits, labels, temperature):
    z = logits.double() / temperature
    lp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return lp, compute_entropy(z)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
def test_log_probs_from_logits_are_of_the_tempered_softmax(temperature):
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (2, 5))
    lp, ent = log_probs_from_logits(logits, labels, True, temperature=temperature)
    ref_lp, ref_ent = _tempered_reference(logits, labels, temperature)
    assert torch.allclose(lp, ref_lp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    # the tempered log-probs are a normalised distribution over the vocabulary
    all_lp = torch.stack([log_probs_from_logits(logits, torch.full_like(labels, v), temperature=temperature)[0]
                          for v in range(11)], -1)
    assert torch.allclose(all_lp.exp().sum(-1), torch.ones(2, 5, dtype=torch.float64))


def test_temperature_one_is_the_untempered_default():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 7)
    labels = torch.randint(0, 7, (3, 4))
    lp, ent = log_probs_from_logits(logits, labels, True)
    lp1, ent1 = log_probs_from_logits(logits, labels, True, temperature=1.0)
    assert torch.equal(lp, lp1) and torch.equal(ent, ent1)
    assert log_probs_from_logits(logits, labels)[1] is None


def test_tempered_bf16_logits_are_reduced_in_float32():
    torch.manual_seed(2)
    logits = (torch.randn(2, 3, 9) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 9, (2, 3))
    lp, ent = log_probs_from_logits(logits, labels, True, temperature=0.6)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_lp, ref_ent = _tempered_reference(logits.float(), labels, 0.6)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)


def test_get_response_log_probs_temperature_and_grad():
    lm = _TableLM()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    labels = torch.tensor([[2, 3, 0], [5, 6, 1]])
    out = get_response_log_probs(lm, ids, labels, True, temperature=0.5)
    ref_lp, ref_ent = _tempered_reference(lm.table[ids].detach(), labels, 0.5)
    assert torch.allclose(out["log_probs"].double(), ref_lp, atol=1e-6)
    assert torch.allclose(out["token_entropy"].double(), ref_ent, atol=1e-6)
    out["log_probs"].sum().backward()
    assert lm.table.grad is not None and torch.isfinite(lm.table.grad).all()


def test_sum_response_log_probs_with_temperature(char_tokenizer):
    lm = _TableLM(vocab=len(char_tokenizer))
    sums, _ = sum_response_log_probs(lm, char_tokenizer, ["ab", "c"], ["cd", "abba"], temperature=2.0)
    batch = tokenize_prompt_and_output(["ab", "c"], ["cd", "abba"], char_tokenizer)
    lp = get_response_log_probs(lm, batch["input_ids"], batch["labels"], temperature=2.0)["log_probs"]
    assert torch.allclose(sums, (lp * batch["response_mask"]).sum(-1))
    plain, _ = sum_response_log_probs(lm, char_tokenizer, ["ab", "c"], ["cd", "abba"])
    assert not torch.allclose(sums, plain)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_temperature_must_be_positive(bad, char_tokenizer):
    logits, labels = torch.randn(1, 2, 4), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_logits(logits, labels, temperature=bad)
    lm = _TableLM()
    with pytest.raises(ValueError, match="temperature"):
        get_response_log_probs(lm, torch.tensor([[1, 2]]), torch.tensor([[2, 3]]), temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        sum_response_log_probs(_TableLM(vocab=len(char_tokenizer)), char_tokenizer, ["a"], ["b"], temperature=bad)


def test_tempered_log_probs_gradcheck():
    torch.manual_seed(3)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda z: log_probs_from_logits(z, labels, True, temperature=0.7), (logits,))
    assert torch.autograd.gradcheck(lambda z: log_probs_from_logits(z, labels, True, temperature=1.0), (logits,))


# ---------------------------------------------------------------- chunks (models: tests/models/test_memory.py)


def test_log_probs_from_logits_chunks_with_the_same_values_and_gradients():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    lp, ent = log_probs_from_logits(logits, labels, True, temperature=0.6)
    g_ref = torch.autograd.grad(lp.sum() + ent.sum(), logits)[0]
    lp2, ent2 = log_probs_from_logits(logits, labels, True, temperature=0.6, chunk_tokens=4)
    g = torch.autograd.grad(lp2.sum() + ent2.sum(), logits)[0]
    assert torch.allclose(lp, lp2, atol=1e-13) and torch.allclose(ent, ent2, atol=1e-13)
    assert torch.allclose(g, g_ref, atol=1e-13)
    assert torch.autograd.gradcheck(lambda z: log_probs_from_logits(z, labels, True, temperature=0.6, chunk_tokens=4),
                                    (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_never_overwrites_the_callers_logits(dtype):
    torch.manual_seed(4)
    logits = (torch.randn(2, 6, 9) * 3).to(dtype)
    before = logits.clone()
    labels = torch.randint(0, 9, (2, 6))
    with torch.no_grad():
        for chunk in (None, 5):
            lp, ent = log_probs_from_logits(logits, labels, True, temperature=0.5, chunk_tokens=chunk)
    assert torch.equal(logits, before)
    # the in-place arithmetic on a private float32 copy gives the out-of-place results bit for bit
    ref_lp, ref_ent = log_probs_from_logits(logits.float().requires_grad_(), labels, True, temperature=0.5,
                                            chunk_tokens=5)
    assert torch.equal(lp, ref_lp.detach()) and torch.equal(ent, ref_ent.detach())


def test_pack_rows():
    assert pack_rows([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    assert pack_rows([2, 9, 2], 8) == [[0], [1], [2]]  # a row longer than the budget goes alone
    assert pack_rows([1, 2, 3], 100) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        pack_rows([1], 0)
