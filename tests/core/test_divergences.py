"""grpolab.core.divergences against a plain float64 reference written here: probabilities by an
explicit softmax, each KL an explicit sum over the vocabulary of ``xlogy(p, p) - xlogy(p, q)``, the
GKD mixture formed in probability space. Values and gradients (autograd through the reference, and
the closed forms of the two KLs) are compared in float64, tightly: both sides round at 2**-53, so
anything beyond ~1e-12 is a difference in the math, not in rounding."""

import math

import pytest
import torch

from grpolab.core import (
    DIVERGENCES,
    divergence_names,
    forward_kl,
    generalized_jsd,
    get_divergence,
    register_divergence,
    reverse_kl,
    unregister_divergence,
)

NAMES = ("forward_kl", "reverse_kl", "generalized_jsd")
F64 = dict(rtol=1e-10, atol=1e-12)
EPS32 = torch.finfo(torch.float32).eps


def ref_probs(logits, temperature):
    z = logits.double() / temperature
    e = torch.exp(z - z.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def ref_kl(p, q):
    """sum_v p_v log(p_v / q_v), one vocabulary entry at a time (0 log 0 = 0)."""
    return sum(torch.xlogy(p[..., v], p[..., v]) - torch.xlogy(p[..., v], q[..., v]) for v in range(p.shape[-1]))


def reference(name, student_logits, teacher_logits, temperature=1.0, beta=0.5):
    p_s, p_t = ref_probs(student_logits, temperature), ref_probs(teacher_logits, temperature)
    if name == "forward_kl" or (name == "generalized_jsd" and beta == 0):
        return ref_kl(p_t, p_s)
    if name == "reverse_kl" or (name == "generalized_jsd" and beta == 1):
        return ref_kl(p_s, p_t)
    m = (1 - beta) * p_s + beta * p_t
    return beta * ref_kl(p_t, m) + (1 - beta) * ref_kl(p_s, m)


def logits(*shape, seed, scale=2.0, dtype=torch.float64):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).to(dtype)


def value_and_grad(fn, student, teacher, weights, **kw):
    """``fn``'s value and d(sum(weights * value)) / d student (random weights: every position's
    gradient counts, with its own sign and size)."""
    student = student.detach().clone().requires_grad_(True)
    value = fn(student, teacher, **kw)
    (grad,) = torch.autograd.grad((weights * value).sum(), student)
    return value.detach(), grad


CASES = [(n, t, b) for n in ("forward_kl", "reverse_kl") for t in (1.0, 0.7, 1.3) for b in (0.3,)] + [
    ("generalized_jsd", t, b) for t in (1.0, 0.7, 1.3) for b in (0.0, 0.3, 0.5, 0.9, 1.0)]


@pytest.mark.parametrize("name,temperature,beta", CASES)
def test_values_and_gradients_equal_the_float64_reference(name, temperature, beta):
    s, t, w = logits(4, 3, 11, seed=0), logits(4, 3, 11, seed=1), logits(4, 3, seed=2)
    got = value_and_grad(get_divergence(name), s, t, w, temperature=temperature, beta=beta)
    want = value_and_grad(lambda a, b, **kw: reference(name, a, b, **kw), s, t, w, temperature=temperature, beta=beta)
    assert got[0].shape == (4, 3) and got[0].dtype == torch.float64
    assert (got[0] > 0).all()
    torch.testing.assert_close(got[0], want[0], **F64)
    torch.testing.assert_close(got[1], want[1], **F64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_kl_gradients_have_their_closed_forms(temperature):
    """d KL(t||s)/dz_s = (p_s - p_t) / T and d KL(s||t)/dz_s = p_s (log p_s - log p_t - KL(s||t)) / T."""
    s, t, ones = logits(5, 9, seed=3), logits(5, 9, seed=4), torch.ones(5, dtype=torch.float64)
    p_s, p_t = ref_probs(s, temperature), ref_probs(t, temperature)
    _, g_fwd = value_and_grad(forward_kl, s, t, ones, temperature=temperature)
    rev, g_rev = value_and_grad(reverse_kl, s, t, ones, temperature=temperature)
    torch.testing.assert_close(g_fwd, (p_s - p_t) / temperature, **F64)
    torch.testing.assert_close(g_rev, p_s * (p_s.log() - p_t.log() - rev[:, None]) / temperature, **F64)


def test_the_jsd_ends_are_trls_convention_not_the_formulas_limits():
    s, t = logits(6, 13, seed=5), logits(6, 13, seed=6)
    assert torch.equal(generalized_jsd(s, t, beta=0.0), forward_kl(s, t))
    assert torch.equal(generalized_jsd(s, t, beta=1.0), reverse_kl(s, t))
    # the formula itself vanishes at both ends, at the rate of the KL each end is replaced by
    b = 1e-6
    torch.testing.assert_close(generalized_jsd(s, t, beta=b) / b, forward_kl(s, t), rtol=1e-4, atol=0)
    torch.testing.assert_close(generalized_jsd(s, t, beta=1 - b) / b, reverse_kl(s, t), rtol=1e-4, atol=0)


@pytest.mark.parametrize("name,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("generalized_jsd", 0.3)])
def test_float32_inputs_agree_within_a_float32_bound(name, beta):
    """Bound: a V-term sum of terms each at most ``scale = max|z| / T + log V`` (a log-prob's size)
    is accurate to V * eps * scale (the classic n*u bound); times 4 for the two log-softmaxes, their
    difference and the mixture. A swapped or mis-tempered divergence is off by O(1)."""
    temperature, vocab = 0.7, 50
    s, t, w = logits(8, vocab, seed=7), logits(8, vocab, seed=8), logits(8, seed=9)
    scale = max(s.abs().max(), t.abs().max()).item() / temperature + math.log(vocab)
    tol = 4 * vocab * EPS32 * scale
    got = value_and_grad(get_divergence(name), s.float(), t.float(), w.float(), temperature=temperature, beta=beta)
    want = value_and_grad(lambda a, b, **kw: reference(name, a, b, **kw), s, t, w, temperature=temperature, beta=beta)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=tol)
    torch.testing.assert_close(got[1].double(), want[1], rtol=0, atol=tol)


@pytest.mark.parametrize("name", NAMES)
def test_results_are_float32_at_least(name):
    s, t = logits(2, 7, seed=10, dtype=torch.float32), logits(2, 7, seed=11, dtype=torch.float32)
    assert get_divergence(name)(s.bfloat16(), t.bfloat16()).dtype == torch.float32
    assert get_divergence(name)(s.half(), t.bfloat16()).dtype == torch.float32
    assert get_divergence(name)(s.double(), t.double()).dtype == torch.float64
    assert get_divergence(name)(s, t.double()).dtype == torch.float64


@pytest.mark.parametrize("name,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("generalized_jsd", 0.3),
                                       ("generalized_jsd", 0.5)])
def test_identical_distributions_give_zero_and_no_gradient(name, beta):
    z = logits(4, 17, seed=12)
    value, grad = value_and_grad(get_divergence(name), z, z.clone(), torch.ones(4, dtype=torch.float64),
                                 temperature=0.7, beta=beta)
    torch.testing.assert_close(value, torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-14)
    # and a different teacher is not zero (the check above could pass for a divergence that is always 0)
    assert (get_divergence(name)(z, z.flip(-1), beta=beta) > 1e-3).all()


@pytest.mark.parametrize("name,beta", [("forward_kl", 0.5), ("generalized_jsd", 0.3), ("generalized_jsd", 0.5)])
def test_a_teacher_that_masks_tokens_gives_finite_values_and_gradients(name, beta):
    s, t, w = logits(4, 11, seed=13), logits(4, 11, seed=14), logits(4, seed=15)
    t[:, [0, 3, 7]] = -math.inf
    got = value_and_grad(get_divergence(name), s, t, w, beta=beta)
    want = value_and_grad(lambda a, b, **kw: reference(name, a, b, **kw), s, t, w, beta=beta)
    assert got[0].isfinite().all() and got[1].isfinite().all()
    torch.testing.assert_close(got[0], want[0], **F64)
    torch.testing.assert_close(got[1], want[1], **F64)


def test_reverse_kl_is_infinite_not_nan_where_the_student_has_mass_the_teacher_masks():
    s, t = logits(3, 11, seed=16), logits(3, 11, seed=17)
    t[0, 2] = -math.inf
    value = reverse_kl(s, t)
    assert value[0] == math.inf and value[1:].isfinite().all()


@pytest.mark.parametrize("name,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("generalized_jsd", 0.3)])
def test_tokens_both_models_mask_count_as_absent(name, beta):
    """Columns at -inf in both are the same as a smaller vocabulary: equal values and gradients
    elsewhere, a zero gradient there, and no NaN anywhere (the log-sum-exp of two -inf is NaN in
    its backward unless kept away from it)."""
    s, t, w = logits(4, 12, seed=18), logits(4, 12, seed=19), logits(4, seed=20)
    masked, kept = [1, 5, 6], [v for v in range(12) if v not in (1, 5, 6)]
    s[:, masked] = t[:, masked] = -math.inf
    got = value_and_grad(get_divergence(name), s, t, w, temperature=1.3, beta=beta)
    want = value_and_grad(get_divergence(name), s[:, kept], t[:, kept], w, temperature=1.3, beta=beta)
    assert got[0].isfinite().all() and not got[1].isnan().any()
    torch.testing.assert_close(got[0], want[0], **F64)
    torch.testing.assert_close(got[1][:, kept], want[1], **F64)
    assert (got[1][:, masked] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_teacher_logit_gives_nan_at_its_position_only(name):
    s, t = logits(3, 11, seed=21), logits(3, 11, seed=22)
    t[1, 4] = math.nan
    value = get_divergence(name)(s, t, beta=0.3)
    assert value[1].isnan() and value[[0, 2]].isfinite().all()


@pytest.mark.parametrize("name", NAMES)
def test_garbage_at_padded_positions_does_not_reach_masked_sums_or_real_gradients(name):
    """The caller masks with ``torch.where``; positions are independent, so inf/NaN/huge logits at
    padded positions change neither the masked sum nor any real position's gradient. (``value *
    mask`` would be NaN: 0 * inf.)"""
    s, t, w = logits(3, 5, 10, seed=23), logits(3, 5, 10, seed=24), logits(3, 5, seed=25)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    s_bad, t_bad = s.clone(), t.clone()
    s_bad[1, 3], s_bad[1, 4, 2], s_bad[2, 1:] = math.inf, math.nan, 1e30
    t_bad[~mask] = math.nan
    t_bad[2, 2:, 0] = -math.inf

    def masked(a, b, **kw):
        return torch.where(mask, get_divergence(name)(a, b, **kw), 0.0)

    clean = value_and_grad(masked, s, t, w, beta=0.3)
    dirty = value_and_grad(masked, s_bad, t_bad, w, beta=0.3)
    assert not torch.equal(clean[0], torch.zeros_like(clean[0]))
    torch.testing.assert_close(dirty[0], clean[0], rtol=0, atol=0)
    torch.testing.assert_close(dirty[1][mask], clean[1][mask], rtol=0, atol=0)
    assert (get_divergence(name)(s_bad, t_bad, beta=0.3) * mask).sum().isnan()


def test_the_teacher_gets_no_gradient():
    s, t = logits(2, 7, seed=26).requires_grad_(True), logits(2, 7, seed=27).requires_grad_(True)
    for name in NAMES:
        grads = torch.autograd.grad(get_divergence(name)(s, t).sum(), (s, t), allow_unused=True)
        assert grads[0] is not None and grads[1] is None, name


@pytest.mark.parametrize("beta", [-0.1, 1.5, math.nan])
def test_beta_outside_zero_one_is_refused(beta):
    with pytest.raises(ValueError, match="beta must be in \\[0, 1\\]"):
        generalized_jsd(logits(2, 5, seed=28), logits(2, 5, seed=29), beta=beta)


@pytest.mark.parametrize("name", NAMES)
def test_bad_temperature_and_vocabulary_mismatch_are_refused(name):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        get_divergence(name)(logits(2, 5, seed=30), logits(2, 5, seed=31), temperature=0.0)
    with pytest.raises(ValueError, match="vocabularies differ: 5 vs 6"):
        get_divergence(name)(logits(2, 5, seed=30), logits(2, 6, seed=31))


def test_the_registry_holds_the_three_and_checks_names():
    assert divergence_names() == NAMES == tuple(DIVERGENCES)
    assert get_divergence("forward_kl") is forward_kl and get_divergence("reverse_kl") is reverse_kl
    with pytest.raises(ValueError, match="unknown divergence 'tvd'; expected one of forward_kl, reverse_kl, "
                                         "generalized_jsd$"):
        get_divergence("tvd")
    with pytest.raises(ValueError, match="divergence 'forward_kl' is already registered"):
        register_divergence("forward_kl")(reverse_kl)
    assert get_divergence("forward_kl") is forward_kl

    @register_divergence("tvd")
    def total_variation(student_logits, teacher_logits, *, temperature=1.0, beta=0.5):
        return 0.5 * (student_logits.softmax(-1) - teacher_logits.detach().softmax(-1)).abs().sum(-1)

    try:
        assert divergence_names() == NAMES + ("tvd",) and get_divergence("tvd") is total_variation
        with pytest.raises(ValueError, match="already registered"):
            register_divergence("tvd")(total_variation)
        replacement = register_divergence("tvd", replace=True)(lambda s, t, **kw: s.sum(-1) * 0)
        assert get_divergence("tvd") is replacement
    finally:
        assert unregister_divergence("tvd") is replacement
    assert divergence_names() == NAMES
    with pytest.raises(ValueError, match="unknown divergence 'tvd'"):
        unregister_divergence("tvd")
