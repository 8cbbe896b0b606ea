"""grpolab.core.ratio_losses: GSPO, CISPO and SAPO (hand-computed values and gradients)."""

import math

import pytest
import torch

from grpolab.core import (
    compute_cispo_loss,
    compute_gspo_loss,
    compute_policy_gradient_loss,
    compute_sapo_loss,
    grpo_microbatch_train_step,
)

LOG = math.log


# ---------------------------------------------------------------- GSPO
def _gspo_batch():
    """Row 0: ratios 1.25, 1.0 (+ a padding token that must not count): s_0 = sqrt(1.25).
    Row 1: ratios 0.25, 0.5, 1.0: s_1 = (1/8) ** (1/3) = 0.5 exactly."""
    lp = torch.tensor([[LOG(0.5), LOG(0.5), 5.0], [LOG(0.25), LOG(0.5), LOG(0.3)]], dtype=torch.float64)
    old = torch.tensor([[LOG(0.4), LOG(0.5), -7.0], [LOG(1.0), LOG(1.0), LOG(0.3)]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return lp, old, mask


def test_gspo_sequence_ratio_and_clip_by_hand():
    lp, old, mask = _gspo_batch()
    s0 = math.sqrt(1.25)  # 1.1180339887
    loss, meta = compute_gspo_loss(torch.tensor([1.0, -1.0]), lp, old, mask, 0.2)
    # row 0: A=+1, s=1.118 inside [0.8, 1.2] -> -s; row 1: A=-1, s=0.5 -> -min(-0.5, -0.8) = 0.8 (clipped)
    assert loss[0, :2].tolist() == pytest.approx([-s0, -s0], rel=1e-12)
    assert loss[1].tolist() == pytest.approx([0.8, 0.8, 0.8], rel=1e-12)
    assert meta["clipped"][:, :2].tolist() == [[False, False], [True, True]]
    assert meta["ratio"][0, :2].tolist() == pytest.approx([s0, s0]) and meta["ratio"][1, 0].item() == pytest.approx(0.5)


def test_gspo_paper_cliprange_and_gradient_by_hand():
    lp, old, mask = _gspo_batch()
    s0 = math.sqrt(1.25)
    # GSPO's ranges (3e-4, 4e-4): A > 0 and s = 1.118 -> clipped at 1.0004, no gradient
    loss, meta = compute_gspo_loss(torch.tensor([1.0, 1.0]), lp, old, mask, 3e-4, cliprange_high=4e-4)
    assert loss[0, 0].item() == pytest.approx(-1.0004) and meta["clipped"][0, 0]
    # A = -2: -min(-2s, -2*1.0004) = 2s, unclipped; masked_mean over 2 tokens: dL/dlp_t = 2 * s * 1/2 = s
    leaf = lp[:1].clone().requires_grad_(True)
    loss, _ = grpo_microbatch_train_step(leaf, mask[:1], 1, "gspo", advantages=torch.tensor([-2.0]),
                                         old_log_probs=old[:1], cliprange=3e-4, cliprange_high=4e-4)
    assert loss.item() == pytest.approx(2 * s0)
    assert leaf.grad[0].tolist() == pytest.approx([s0, s0, 0.0], rel=1e-12)


def test_gspo_gradient_by_hand_in_a_batch():
    lp, old, mask = _gspo_batch()
    leaf = lp.clone().requires_grad_(True)
    grpo_microbatch_train_step(leaf, mask, 1, "gspo", advantages=torch.tensor([1.0, -1.0]), old_log_probs=old,
                               cliprange=0.2)
    # mean over 2 sequences of -A_i s_i; row 0: d(-s_0)/dlp_t = -s_0/2, /2 sequences; row 1 clipped: 0
    s0 = math.sqrt(1.25)
    expected = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(leaf.grad, expected, rtol=1e-12, atol=0)


def _policy_log_probs(param, tokens):
    return torch.log_softmax(param, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_gspo_gradient_is_the_analytic_sequence_gradient():
    """grad of masked_mean GSPO = 1/B sum_i -A_i * s_i * 1[unclipped] * mean_t grad log pi(y_t) (GSPO eq. 10)."""
    torch.manual_seed(0)
    B, T, V = 6, 5, 4
    base = torch.randn(B, T, V, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T))
    mask = torch.arange(T)[None, :] < torch.tensor([5, 1, 3, 4, 2, 5])[:, None]
    old = _policy_log_probs(base + 0.3 * torch.randn_like(base), tokens).detach()
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5], dtype=torch.float64)
    p = base.clone().requires_grad_(True)
    _, meta = grpo_microbatch_train_step(_policy_log_probs(p, tokens), mask, 1, "gspo", advantages=adv,
                                         old_log_probs=old, cliprange=0.1)
    lp = _policy_log_probs(base, tokens)
    n = mask.sum(-1)
    s = torch.exp(((lp - old) * mask).sum(-1) / n)
    live = ~meta["clipped"][:, 0]
    assert 0 < live.sum() < B  # both cases occur
    coeff = (-adv * s * live / n / B).detach()
    q = base.clone().requires_grad_(True)
    (coeff[:, None] * _policy_log_probs(q, tokens) * mask).sum().backward()
    assert torch.allclose(p.grad, q.grad, atol=1e-12)


def test_gspo_needs_the_mask_and_the_cliprange():
    lp, old, mask = _gspo_batch()
    with pytest.raises(ValueError, match="loss_type='gspo' requires response_mask"):
        compute_policy_gradient_loss(lp, "gspo", advantages=torch.ones(2), old_log_probs=old, cliprange=0.2)
    with pytest.raises(ValueError, match="cliprange"):
        compute_policy_gradient_loss(lp, "gspo", advantages=torch.ones(2), old_log_probs=old, response_mask=mask)


# ---------------------------------------------------------------- CISPO
def _cispo_tokens():
    # ratios 1.5, 0.25, 1.0
    lp = torch.tensor([[LOG(0.6), LOG(0.1), LOG(0.5)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[LOG(0.4), LOG(0.4), LOG(0.5)]], dtype=torch.float64)
    return lp, old


def test_cispo_weights_values_and_gradient_by_hand():
    lp, old = _cispo_tokens()
    loss, meta = compute_cispo_loss(torch.tensor([2.0]), lp, old, 0.2)
    # weights min(r, 1.2) = [1.2, 0.25, 1.0] (no lower bound); loss = -w * A * log pi
    assert loss[0].tolist() == pytest.approx([-2.4 * LOG(0.6), -0.5 * LOG(0.1), -2.0 * LOG(0.5)], rel=1e-12)
    assert loss[0].tolist() == pytest.approx([1.2259814, 1.1512925, 1.3862944], rel=1e-6)
    assert meta["clipped"].tolist() == [[True, False, False]]
    loss.sum().backward()
    # the weight is a constant: d/dlp = -w * A, and the clipped token keeps its gradient (unlike PPO)
    assert lp.grad[0].tolist() == pytest.approx([-2.4, -0.5, -2.0], rel=1e-12)


def test_cispo_lower_bound_option_and_registry():
    lp, old = _cispo_tokens()
    loss, meta = compute_policy_gradient_loss(lp, "cispo", advantages=torch.tensor([2.0]), old_log_probs=old,
                                              cliprange=0.2, cispo_low=0.5)
    # weights [1.2, max(0.25, 0.5) = 0.5, 1.0]
    assert loss[0, 1].item() == pytest.approx(-2 * 0.5 * LOG(0.1))
    assert meta["clipped"].tolist() == [[True, True, False]]
    same, _ = compute_policy_gradient_loss(lp, "cispo", advantages=torch.tensor([2.0]), old_log_probs=old,
                                           cliprange=0.9, cliprange_high=0.2, cispo_low=0.5)
    assert torch.equal(loss, same)  # cliprange_high wins over cliprange for the upper bound
    _, step_meta = grpo_microbatch_train_step(lp, torch.ones(1, 3, dtype=torch.bool), 1, "cispo",
                                              advantages=torch.tensor([2.0]), old_log_probs=old, cliprange=0.2)
    assert step_meta["clip_fraction"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="loss_type='cispo' requires cliprange_high or cliprange"):
        compute_policy_gradient_loss(lp, "cispo", advantages=torch.tensor([2.0]), old_log_probs=old)


# ---------------------------------------------------------------- SAPO
def test_sapo_values_by_hand():
    r = torch.tensor([[1.0, 1.0 + LOG(3.0)]], dtype=torch.float64)
    loss, _ = compute_sapo_loss(torch.tensor([1.0]), r.log(), torch.zeros_like(r))
    # tau_pos = 1: f(1) = 0.5 * 4 = 2; f(1 + ln 3) = sigmoid(ln 3) * 4 = 0.75 * 4 = 3
    assert loss[0].tolist() == pytest.approx([-2.0, -3.0], rel=1e-12)
    loss, _ = compute_policy_gradient_loss(torch.zeros(1, 1), "sapo", advantages=torch.tensor([-1.0]),
                                           old_log_probs=torch.zeros(1, 1))
    assert loss.item() == pytest.approx(2 / 1.05)  # default tau_neg = 1.05: f(1) = 2 / 1.05


@pytest.mark.parametrize(
    "adv, tau_option, r, weight",
    [
        (1.0, {}, 1.0, 1.0),  # sigmoid(0) = 1/2: 4 * 1/2 * 1/2 = 1
        (1.0, {}, 1.0 + LOG(3.0), 0.75),  # sigmoid(ln 3) = 3/4: 4 * 3/4 * 1/4
        (1.0, {}, 1.0 + LOG(4.0), 0.64),  # sigmoid(ln 4) = 4/5: 4 * 4/5 * 1/5
        (-1.0, {"sapo_tau_neg": 2.0}, 1.0 - LOG(3.0) / 2, 0.75),  # 2 (r - 1) = -ln 3: sigmoid = 1/4
        (-1.0, {"sapo_tau_neg": 2.0}, 1.0, 1.0),
    ],
)
def test_sapo_gradient_weight_is_the_stated_derivative(adv, tau_option, r, weight):
    """d loss / d r = -A * 4 sigmoid(tau (r-1)) (1 - sigmoid(tau (r-1))); through log pi it is times r."""
    lp = torch.tensor([[math.log(r)]], dtype=torch.float64, requires_grad=True)
    loss, meta = compute_policy_gradient_loss(lp, "sapo", advantages=torch.tensor([adv]),
                                              old_log_probs=torch.zeros(1, 1, dtype=torch.float64), **tau_option)
    loss.sum().backward()
    assert lp.grad.item() == pytest.approx(-adv * weight * r, rel=1e-12)
    assert meta["ratio"].item() == pytest.approx(r)


def test_sapo_weight_on_a_grid_and_bad_temperatures():
    r = torch.linspace(0.2, 3.0, 15, dtype=torch.float64)
    lp = r.log().unsqueeze(0).requires_grad_(True)
    for adv, tau in ((1.0, 0.7), (-1.0, 1.3)):
        lp.grad = None
        loss, _ = compute_sapo_loss(torch.tensor([adv]), lp, torch.zeros_like(lp), tau_pos=0.7, tau_neg=1.3)
        loss.sum().backward()
        sig = torch.sigmoid(tau * (r - 1))
        assert torch.allclose(lp.grad[0], -adv * 4 * sig * (1 - sig) * r, atol=1e-12)
    with pytest.raises(ValueError, match="temperatures"):
        compute_sapo_loss(torch.tensor([1.0]), lp, lp.detach(), tau_pos=0.0)
