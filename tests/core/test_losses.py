"""grpolab.core.losses: policy-gradient losses (through the registry), value loss, DPO loss."""

import math

import pytest
import torch

from grpolab.core import (
    LOSS_TYPES,
    compute_dpo_loss,
    compute_grpo_clip_loss,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    compute_value_loss,
    entropy_bonus_loss,
    policy_loss_names,
    register_policy_loss,
    unregister_policy_loss,
)


def test_naive_policy_gradient_broadcast():
    a = torch.tensor([[2.0], [-1.0]])
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    assert compute_naive_policy_gradient_loss(a, lp).tolist() == [[2.0, 4.0], [-3.0, -4.0]]
    assert compute_naive_policy_gradient_loss(a.squeeze(1), lp).tolist() == [[2.0, 4.0], [-3.0, -4.0]]


def test_grpo_clip_loss_edges():
    eps = 0.2
    old = torch.zeros(2, 4)
    ratios = torch.tensor([0.5, 0.9, 1.1, 1.5])
    new = ratios.log().expand(2, 4)
    adv = torch.tensor([[1.0], [-1.0]])
    loss, meta = compute_grpo_clip_loss(adv, new, old, eps)
    # A>0: min(r, clip(r)) -> [0.5, 0.9, 1.1, 1.2]; A<0: min(-r, -clip(r)) -> [-0.8, -0.9, -1.1, -1.5]
    assert torch.allclose(loss[0], -torch.tensor([0.5, 0.9, 1.1, 1.2]), atol=1e-6)
    assert torch.allclose(loss[1], torch.tensor([0.8, 0.9, 1.1, 1.5]), atol=1e-6)
    assert meta["clipped"].tolist() == [[False, False, False, True], [True, False, False, False]]
    # exactly at the edge nothing is "clipped" and the loss is continuous
    at_edge, meta_e = compute_grpo_clip_loss(torch.tensor([[1.0]]), torch.tensor([[math.log(1.2)]]), torch.zeros(1, 1),
                                             eps)
    assert at_edge.item() == pytest.approx(-1.2) and not meta_e["clipped"].any()


def test_grpo_clip_asymmetric_dapo():
    new = torch.tensor([[math.log(1.25), math.log(0.7)]])
    loss, _ = compute_grpo_clip_loss(torch.tensor([[1.0]]), new, torch.zeros(1, 2), 0.2, cliprange_high=0.28)
    assert torch.allclose(loss, -torch.tensor([[1.25, 0.7]]), atol=1e-6)
    loss, _ = compute_grpo_clip_loss(torch.tensor([[1.0]]), torch.tensor([[math.log(1.4)]]), torch.zeros(1, 1), 0.2,
                                     cliprange_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    loss, _ = compute_grpo_clip_loss(torch.tensor([[-1.0]]), torch.tensor([[math.log(0.5)]]), torch.zeros(1, 1), 0.2,
                                     cliprange_low=0.1)
    assert loss.item() == pytest.approx(0.9)


def test_compute_policy_gradient_loss_dispatch_and_errors():
    lp = torch.tensor([[-1.0, -2.0]])
    r = torch.tensor([[3.0]])
    a = torch.tensor([[0.5]])
    old = torch.tensor([[-1.0, -2.0]])
    loss, meta = compute_policy_gradient_loss(lp, "no_baseline", raw_rewards=r)
    assert loss.tolist() == [[3.0, 6.0]] and meta == {}
    loss, _ = compute_policy_gradient_loss(lp, "reinforce_with_baseline", advantages=a)
    assert loss.tolist() == [[0.5, 1.0]]
    loss, meta = compute_policy_gradient_loss(lp, "grpo_clip", advantages=a, old_log_probs=old, cliprange=0.2)
    assert torch.allclose(loss, torch.tensor([[-0.5, -0.5]])) and "clipped" in meta
    loss, _ = compute_policy_gradient_loss(lp + 1.0, "grpo_no_clip", advantages=a, old_log_probs=old)
    assert torch.allclose(loss, torch.full((1, 2), -0.5 * math.e))
    with pytest.raises(ValueError, match="raw_rewards"):
        compute_policy_gradient_loss(lp, "no_baseline", advantages=a)
    with pytest.raises(ValueError, match="old_log_probs"):
        compute_policy_gradient_loss(lp, "grpo_clip", advantages=a, cliprange=0.2)
    with pytest.raises(ValueError, match="cliprange"):
        compute_policy_gradient_loss(lp, "grpo_clip", advantages=a, old_log_probs=old)
    with pytest.raises(ValueError, match="ppo_magic"):
        compute_policy_gradient_loss(lp, "ppo_magic", advantages=a)


def test_value_loss_clipping():
    v = torch.tensor([[1.5, 0.0]])
    old = torch.tensor([[1.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0]])
    loss, meta = compute_value_loss(v, old, ret, 0.2)
    # tok0: unclipped (0.5)^2=.25, clipped v=1.2 -> (0.8)^2=.64 -> max .64 -> *0.5
    assert torch.allclose(loss, torch.tensor([[0.32, 0.5]]))
    assert meta["clipped"].tolist() == [[True, False]]
    plain, _ = compute_value_loss(v, old, ret, None)
    assert torch.allclose(plain, torch.tensor([[0.125, 0.5]]))


def test_dpo_loss_hand_value():
    out = compute_dpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]), torch.tensor([-1.5, -2.0]),
                           torch.tensor([-2.5, -2.0]), beta=0.5)
    z = torch.tensor([0.5 * ((0.5) - (-0.5)), 0.5 * ((0.0) - (1.0))])
    assert out.shape == (2,)
    assert torch.allclose(out, -torch.nn.functional.logsigmoid(z))


def test_loss_gradchecks():
    torch.manual_seed(0)
    d = dict(dtype=torch.float64, requires_grad=True)
    lp = (torch.rand(2, 3, dtype=torch.float64) * -2).requires_grad_(True)
    old = (lp.detach() + torch.tensor([[0.5, -0.5, 0.01], [0.3, -0.02, 0.7]], dtype=torch.float64))
    adv = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: compute_grpo_clip_loss(adv, t, old, 0.2)[0], (lp,))
    ref = torch.randn(2, 3, dtype=torch.float64)
    c, r = torch.randn(4, **d), torch.randn(4, **d)
    rc, rr = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: compute_dpo_loss(a, b, rc, rr, 0.1), (c, r))
    v = torch.randn(2, 3, **d)
    assert torch.autograd.gradcheck(lambda t: compute_value_loss(t, ref, ref + 1.0, 0.2)[0], (v,))


# ---------------------------------------------------------------- the policy-loss registry
BUILTIN_LOSSES = LOSS_TYPES + ("gspo", "cispo", "sapo")


def test_registered_loss_names_start_with_the_cs336_four():
    cs336 = ("no_baseline", "reinforce_with_baseline", "grpo_clip", "grpo_no_clip")
    assert cs336 == LOSS_TYPES
    assert policy_loss_names() == BUILTIN_LOSSES


def test_a_registered_loss_is_reached_by_compute_policy_gradient_loss():
    seen = {}

    @register_policy_loss("my_loss")
    def my_loss(policy_log_probs, *, raw_rewards, advantages, old_log_probs, cliprange, cliprange_high, **options):
        seen.update(cliprange=cliprange, cliprange_high=cliprange_high, options=options, old=old_log_probs)
        return -(advantages.unsqueeze(-1) * 2.0) * policy_log_probs, {"ratio": torch.ones_like(policy_log_probs)}

    lp = torch.tensor([[-1.0, -2.0]])
    try:
        assert "my_loss" in policy_loss_names()
        loss, meta = compute_policy_gradient_loss(lp, "my_loss", advantages=torch.tensor([0.5]), cliprange=0.3,
                                                  cliprange_high=0.4, note="x")
        assert loss.tolist() == [[1.0, 2.0]] and "ratio" in meta
        assert seen == {"cliprange": 0.3, "cliprange_high": 0.4, "options": {"note": "x"}, "old": None}
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("my_loss")(my_loss)
    finally:
        assert unregister_policy_loss("my_loss") is my_loss
    assert policy_loss_names() == BUILTIN_LOSSES
    with pytest.raises(ValueError, match="my_loss"):
        compute_policy_gradient_loss(lp, "my_loss", advantages=torch.tensor([0.5]))


def test_unknown_loss_type_lists_the_registered_names():
    with pytest.raises(ValueError) as err:
        compute_policy_gradient_loss(torch.zeros(1, 1), "ppo_magic", advantages=torch.zeros(1))
    assert str(err.value) == (
        "unknown loss_type 'ppo_magic'; expected one of no_baseline, reinforce_with_baseline, grpo_clip, grpo_no_clip, "
        "gspo, cispo, sapo"
    )


def test_builtin_losses_ignore_extra_options():
    lp = torch.tensor([[-1.0, -2.0]])
    a = torch.tensor([[0.5]])
    mask = torch.tensor([[True, False]])
    for loss_type in LOSS_TYPES:
        kwargs = dict(raw_rewards=a, advantages=a, old_log_probs=lp - 0.1, cliprange=0.2)
        plain, _ = compute_policy_gradient_loss(lp, loss_type, **kwargs)
        extra, _ = compute_policy_gradient_loss(lp, loss_type, **kwargs, response_mask=mask)
        assert torch.equal(plain, extra)


# ---------------------------------------------------------------- PPO dual-clip (Ye et al. 2020)
def test_dual_clip_caps_the_loss_of_negative_advantages():
    # ratios 5, 2, 0.5 for A = -1, and 5 for A = +1; eps 0.2, c = 3
    lp = torch.tensor([[math.log(5.0), math.log(2.0), math.log(0.5)], [math.log(5.0)] * 3], requires_grad=True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([[-1.0], [1.0]])
    plain, _ = compute_grpo_clip_loss(adv, lp, old, 0.2)
    loss, meta = compute_grpo_clip_loss(adv, lp, old, 0.2, dual_clip_c=3.0)
    # A<0: max(-rA, -clip(r)A) = [5, 2, 0.8] -> capped at -cA = 3: [3, 2, 0.8]; A>0 unchanged: -min(5, 1.2) = -1.2
    assert plain[0].tolist() == pytest.approx([5.0, 2.0, 0.8])
    assert loss[0].tolist() == pytest.approx([3.0, 2.0, 0.8])
    assert loss[1].tolist() == pytest.approx([-1.2] * 3) and torch.equal(loss[1], plain[1])
    assert meta["dual_clipped"].tolist() == [[True, False, False], [False] * 3]
    assert meta["clipped"].tolist() == [[True, False, True], [True] * 3]  # gradient cut: dual or ordinary clip
    loss[0].sum().backward()
    # d(-r A)/dlp = r for the unclipped token; the capped and the clipped tokens have none
    assert lp.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0])


def test_dual_clip_through_the_registry_and_off_by_default():
    lp = torch.tensor([[math.log(5.0)]])
    kwargs = {"advantages": torch.tensor([-2.0]), "old_log_probs": torch.zeros(1, 1), "cliprange": 0.2}
    assert compute_policy_gradient_loss(lp, "grpo_clip", **kwargs)[0].item() == pytest.approx(10.0)
    assert compute_policy_gradient_loss(lp, "grpo_clip", **kwargs, dual_clip_c=None)[0].item() == pytest.approx(10.0)
    loss, meta = compute_policy_gradient_loss(lp, "grpo_clip", **kwargs, dual_clip_c=3.0)
    assert loss.item() == pytest.approx(6.0) and meta["dual_clipped"].all()
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        compute_policy_gradient_loss(lp, "grpo_clip", **kwargs, dual_clip_c=1.0)


# ---------------------------------------------------------------- entropy bonus
def test_entropy_bonus_loss_by_hand():
    h = torch.tensor([[0.5, 2.0]], requires_grad=True)
    bonus = entropy_bonus_loss(h, 0.1)
    assert bonus[0].tolist() == pytest.approx([-0.05, -0.2])
    bonus.sum().backward()
    assert h.grad[0].tolist() == pytest.approx([-0.1, -0.1])
