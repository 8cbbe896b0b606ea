"""grpolab.core.kl: estimator values, the gradients they give as loss terms, controllers."""

import math

import pytest
import torch

from grpolab.core import (
    KL_ESTIMATORS,
    KL_LOSS_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    check_kl_loss_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
)


def test_kl_estimators_hand_values():
    lp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    d = math.log(2)
    assert kl_k1(lp, ref).item() == pytest.approx(d)
    assert kl_k2(lp, ref).item() == pytest.approx(0.5 * d * d)
    assert kl_k3(lp, ref).item() == pytest.approx((0.5 - 1) - math.log(0.5))
    assert kl_k3(lp, lp).item() == 0.0


def test_adaptive_kl_controller():
    c = AdaptiveKLController(init_coef=0.2, target=1.0, horizon=10, min_coef=0.1, max_coef=0.3)
    assert c.value == 0.2
    c.update(current_kl=1.05, n_steps=10)  # error 0.05 -> *1.05
    assert c.value == pytest.approx(0.21)
    c.update(current_kl=100.0, n_steps=10)  # error clipped to 0.2 -> *1.2
    assert c.value == pytest.approx(0.252)
    for _ in range(5):
        c.update(100.0, 10)
    assert c.value == 0.3
    for _ in range(50):
        c.update(0.0, 10)
    assert c.value == 0.1
    c2 = AdaptiveKLController()
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.1
    f = FixedKLController(0.05)
    assert f.update(10.0, 100) == 0.05


def test_kl_gradchecks():
    lp = (torch.rand(2, 3, dtype=torch.float64) * -2).requires_grad_(True)
    ref = torch.randn(2, 3, dtype=torch.float64)
    for k in (kl_k1, kl_k2, kl_k3):
        assert torch.autograd.gradcheck(lambda t: k(t, ref), (lp,))


# ---------------------------------------------------------------- what each estimator's gradient estimates
def _expected_loss_gradient(estimator, logits, ref_log_probs):
    """grad_theta of E_{x~pi}[k(x)] with the sampling of x held fixed (a loss term on on-policy
    samples), computed exactly over the support: sum_x stopgrad(pi(x)) * k(log pi(x), log ref(x))."""
    theta = logits.clone().requires_grad_(True)
    log_pi = torch.log_softmax(theta, -1)
    surrogate = (log_pi.exp().detach() * estimator(log_pi, ref_log_probs)).sum()
    (grad,) = torch.autograd.grad(surrogate, theta)
    return grad


def _grad(fn, logits):
    theta = logits.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(torch.log_softmax(theta, -1)), theta)
    return grad


@pytest.mark.parametrize("seed", range(5))
def test_kl_estimators_as_loss_terms_estimate_these_gradients(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 7, generator=g, dtype=torch.float64)  # 3 positions, vocabulary 7
    ref = torch.log_softmax(torch.randn(3, 7, generator=g, dtype=torch.float64), -1)
    reverse = _grad(lambda lp: (lp.exp() * (lp - ref)).sum(), logits)  # grad KL(pi || ref)
    forward = _grad(lambda lp: (ref.exp() * (ref - lp)).sum(), logits)  # grad KL(ref || pi)
    assert not torch.allclose(reverse, forward, atol=1e-3)  # the identities below discriminate

    assert torch.allclose(_expected_loss_gradient(kl_k1, logits, ref), torch.zeros_like(logits), atol=1e-12)
    assert torch.allclose(_expected_loss_gradient(kl_k2, logits, ref), reverse, atol=1e-12)
    assert torch.allclose(_expected_loss_gradient(kl_k3, logits, ref), forward, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_kl_estimator_values_k1_k3_unbiased_k2_biased(seed):
    g = torch.Generator().manual_seed(seed)
    log_pi = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64) * 2, -1)
    ref = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64) * 2, -1)
    pi = log_pi.exp()
    reverse_kl = (pi * (log_pi - ref)).sum()
    assert (pi * kl_k1(log_pi, ref)).sum().item() == pytest.approx(reverse_kl.item(), abs=1e-12)
    assert (pi * kl_k3(log_pi, ref)).sum().item() == pytest.approx(reverse_kl.item(), abs=1e-12)
    assert (pi * kl_k2(log_pi, ref)).sum().item() != pytest.approx(reverse_kl.item(), abs=1e-6)
    assert (kl_k2(log_pi, ref) >= 0).all() and (kl_k3(log_pi, ref) >= -1e-15).all()


def test_kl_loss_estimators_exclude_k1():
    assert KL_LOSS_ESTIMATORS == ("k2", "k3")
    assert set(KL_LOSS_ESTIMATORS) < set(KL_ESTIMATORS)
    check_kl_loss_estimator("k2")
    check_kl_loss_estimator("k3")
    with pytest.raises(ValueError, match=r"kl_estimator 'k1' has zero expected gradient as a loss term.*"
                                         r"use k2 or k3, or apply k1 as a reward penalty"):
        check_kl_loss_estimator("k1")
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        check_kl_loss_estimator("k4")
