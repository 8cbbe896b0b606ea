"""grpolab.core.train_steps: SFT/GRPO micro-batch steps, aggregation, micro-batch invariance."""

import math

import pytest
import torch

from grpolab.core import (
    aggregate_token_loss,
    grpo_microbatch_train_step,
    kl_k3,
    sft_microbatch_train_step,
)


def test_sft_microbatch_train_step_value_and_accumulation():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    m = torch.tensor([[True, True, False], [False, True, True]])
    loss, meta = sft_microbatch_train_step(lp, m, gradient_accumulation_steps=2, normalize_constant=2.0)
    # rows: (1+2)/2 = 1.5 and (5+6)/2 = 5.5 -> mean 3.5 -> /2 = 1.75
    assert loss.dim() == 0 and loss.item() == pytest.approx(1.75)
    expected = -(m.float() / 2.0 / 2.0 / 2.0)
    assert torch.allclose(lp.grad, expected)
    for _ in range(9):
        sft_microbatch_train_step(lp, m, gradient_accumulation_steps=2, normalize_constant=2.0)
    assert torch.allclose(lp.grad, 10 * expected)
    assert meta["num_response_tokens"].item() == 4


def test_grpo_microbatch_train_step_value_and_accumulation():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    m = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([[1.0], [2.0]])
    loss, meta = grpo_microbatch_train_step(lp, m, 4, "reinforce_with_baseline", advantages=adv)
    # per-token -A*lp: [[1,2,3],[2,2,2]] -> row means over mask [1.5, 2] -> mean 1.75 -> /4
    assert loss.item() == pytest.approx(1.75 / 4)
    expected = torch.tensor([[-0.5, -0.5, 0.0], [-2.0, 0.0, 0.0]]) / 2 / 4
    assert torch.allclose(lp.grad, expected)
    for _ in range(9):
        grpo_microbatch_train_step(lp, m, 4, "reinforce_with_baseline", advantages=adv)
    assert torch.allclose(lp.grad, 10 * expected)
    assert meta["num_response_tokens"].item() == 3


def test_grpo_step_clip_metadata_and_kl():
    lp = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    ref = torch.zeros(1, 2)
    m = torch.tensor([[True, True]])
    loss, meta = grpo_microbatch_train_step(
        lp, m, 1, "grpo_clip", advantages=torch.tensor([[1.0]]), old_log_probs=old, cliprange=0.2,
        ref_log_probs=ref, kl_coef=0.1,
    )
    k3 = kl_k3(lp.detach(), ref)
    assert meta["clip_fraction"].item() == pytest.approx(0.5)
    assert meta["kl"].item() == pytest.approx(k3.mean().item())
    assert loss.item() == pytest.approx(((-1.2 - 1.0) + 0.1 * k3.sum().item()) / 2, rel=1e-5)


def _policy_log_probs(param, tokens):
    return torch.log_softmax(param, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("mode", ["masked_mean", "masked_normalize", "token_mean"])
@pytest.mark.parametrize("loss_type", ["reinforce_with_baseline", "grpo_clip"])
def test_loss_normalisation_invariance(mode, loss_type):
    torch.manual_seed(0)
    B, T, V = 8, 6, 5
    base = torch.randn(B, T, V, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T))
    lengths = torch.tensor([1, 6, 3, 2, 5, 4, 6, 1])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, 1, dtype=torch.float64)
    old = _policy_log_probs(base + 0.1 * torch.randn_like(base), tokens).detach()
    kwargs = dict(length_normalization=mode, normalize_constant=float(T))

    def grad_for(splits, use_global_batch):
        p = base.clone().requires_grad_(True)
        total_tokens = mask.sum()
        start = 0
        for size in splits:
            sl = slice(start, start + size)
            start += size
            extra = {}
            if mode == "token_mean":
                extra["global_num_tokens"] = total_tokens
            elif use_global_batch:
                extra["global_batch_size"] = B
            grpo_microbatch_train_step(
                _policy_log_probs(p, tokens)[sl], mask[sl], len(splits), loss_type,
                advantages=adv[sl], old_log_probs=old[sl], cliprange=0.2, **kwargs, **extra,
            )
        return p.grad

    full = grad_for([B], False)
    assert torch.allclose(grad_for([2, 2, 2, 2], False), full, atol=1e-6)
    assert torch.allclose(grad_for([4, 4], False), full, atol=1e-6)
    # unequal (dynamic) micro-batches need the global count
    assert torch.allclose(grad_for([1, 4, 3], True), full, atol=1e-6)


def test_sft_invariance_with_unequal_microbatches():
    torch.manual_seed(1)
    base = torch.randn(6, 4, 3, dtype=torch.float64)
    tokens = torch.randint(0, 3, (6, 4))
    mask = torch.rand(6, 4) > 0.3
    p1 = base.clone().requires_grad_(True)
    sft_microbatch_train_step(_policy_log_probs(p1, tokens), mask, 1, 4.0)
    p2 = base.clone().requires_grad_(True)
    for sl in (slice(0, 1), slice(1, 5), slice(5, 6)):
        sft_microbatch_train_step(_policy_log_probs(p2, tokens)[sl], mask[sl], 3, 4.0, global_batch_size=6)
    assert torch.allclose(p1.grad, p2.grad, atol=1e-9)


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="length_normalization"):
        aggregate_token_loss(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), 1, "median")
    with pytest.raises(ValueError, match="normalize_constant"):
        aggregate_token_loss(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), 1, "masked_normalize")



# ---------------------------------------------------------------- KL estimator choice
def test_k1_in_the_loss_is_refused_before_any_backward():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    m = torch.tensor([[True, True]])
    with pytest.raises(ValueError, match=r"kl_estimator 'k1' has zero expected gradient as a loss term"):
        grpo_microbatch_train_step(lp, m, 1, "reinforce_with_baseline", advantages=torch.tensor([[1.0]]),
                                   ref_log_probs=torch.zeros(1, 2), kl_coef=0.1, kl_estimator_name="k1")
    assert lp.grad is None
    # measured only (kl_coef 0): allowed, and reported
    _, meta = grpo_microbatch_train_step(lp, m, 1, "reinforce_with_baseline", advantages=torch.tensor([[1.0]]),
                                         ref_log_probs=torch.zeros(1, 2), kl_coef=0.0, kl_estimator_name="k1")
    assert meta["kl"].item() == pytest.approx(-1.5)


def test_k2_penalty_adds_its_gradient():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    m = torch.tensor([[True, True]])
    loss, meta = grpo_microbatch_train_step(lp, m, 1, "reinforce_with_baseline", advantages=torch.tensor([[0.0]]),
                                            ref_log_probs=ref, kl_coef=0.5, kl_estimator_name="k2")
    k2 = 0.5 * (lp.detach() - ref) ** 2
    assert loss.item() == pytest.approx(0.5 * k2.mean().item())
    assert torch.allclose(lp.grad, 0.5 * (lp.detach() - ref) / 2)
    assert meta["kl"].item() == pytest.approx(k2.mean().item())


def test_train_step_passes_response_mask_to_the_loss():
    from grpolab.core import register_policy_loss, unregister_policy_loss

    @register_policy_loss("test_sequence_level")
    def sequence_level(policy_log_probs, *, advantages, response_mask, **_):
        seq_lp = (policy_log_probs * response_mask).sum(-1, keepdim=True) / response_mask.sum(-1, keepdim=True)
        return (-advantages * seq_lp).expand_as(policy_log_probs), {}

    lp = torch.tensor([[-1.0, -3.0, -9.0]], requires_grad=True)
    m = torch.tensor([[True, True, False]])
    try:
        loss, _ = grpo_microbatch_train_step(lp, m, 1, "test_sequence_level", advantages=torch.tensor([[2.0]]))
    finally:
        unregister_policy_loss("test_sequence_level")
    assert loss.item() == pytest.approx(4.0)


# ---------------------------------------------------------------- entropy bonus, loss options
def test_entropy_bonus_in_the_train_step_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    h = torch.tensor([[1.0, 2.0, 9.0]], requires_grad=True)
    m = torch.tensor([[True, True, False]])
    loss, meta = grpo_microbatch_train_step(lp, m, 1, "reinforce_with_baseline", advantages=torch.tensor([0.0]),
                                            token_entropy=h, entropy_coef=0.5)
    # -0.5 * H over the 2 response tokens: -(0.5 + 1.0) / 2 = -0.75; d/dH = -0.5 / 2 per response token
    assert loss.item() == pytest.approx(-0.75)
    assert h.grad[0].tolist() == pytest.approx([-0.25, -0.25, 0.0])
    assert meta["entropy"].item() == pytest.approx(1.5)
    # coef 0: only measured
    h.grad = None
    loss, meta = grpo_microbatch_train_step(lp, m, 1, "reinforce_with_baseline", advantages=torch.tensor([0.0]),
                                            token_entropy=h)
    assert loss.item() == 0.0 and h.grad is None and meta["entropy"].item() == pytest.approx(1.5)


def test_entropy_bonus_gradient_matches_the_entropy_gradient():
    """dH/dz_v = -p_v (log p_v + H) for softmax logits z: the bonus adds -coef * that, averaged."""
    from grpolab.core import compute_entropy

    torch.manual_seed(0)
    z = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 4, (2, 3))
    m = torch.tensor([[True, True, True], [True, False, False]])
    grpo_microbatch_train_step(_policy_log_probs(z, tokens), m, 1, "reinforce_with_baseline",
                               advantages=torch.zeros(2, dtype=torch.float64), token_entropy=compute_entropy(z),
                               entropy_coef=0.1)
    p = torch.softmax(z.detach(), -1)
    h = -(p * p.log()).sum(-1, keepdim=True)
    d_h = -p * (p.log() + h)
    weight = m.double() / m.sum(-1, keepdim=True) / 2  # masked_mean per row, then mean over 2 rows
    assert torch.allclose(z.grad, -0.1 * weight[..., None] * d_h, atol=1e-12)


def test_loss_options_reach_the_loss():
    lp = torch.tensor([[math.log(5.0)]], requires_grad=True)
    m = torch.tensor([[True]])
    kwargs = {"advantages": torch.tensor([-1.0]), "old_log_probs": torch.zeros(1, 1), "cliprange": 0.2}
    loss, meta = grpo_microbatch_train_step(lp, m, 1, "grpo_clip", **kwargs, loss_options={"dual_clip_c": 3.0})
    assert loss.item() == pytest.approx(3.0) and meta["dual_clip_fraction"].item() == 1.0
    assert lp.grad.item() == 0.0
    loss, meta = grpo_microbatch_train_step(lp, m, 1, "grpo_clip", **kwargs)
    assert loss.item() == pytest.approx(5.0) and "dual_clip_fraction" not in meta


# ---------------------------------------------------------------- micro-batch invariance of the new terms
NEW_TERMS = {
    "gspo": ("gspo", {}, False),
    "cispo": ("cispo", {"cispo_low": 0.1}, False),
    "sapo": ("sapo", {"sapo_tau_pos": 1.0, "sapo_tau_neg": 2.0}, False),
    "dual_clip": ("grpo_clip", {"dual_clip_c": 1.5}, False),
    "entropy_and_is": ("grpo_clip", {}, True),
}


@pytest.mark.parametrize("mode", ["masked_mean", "masked_normalize", "token_mean"])
@pytest.mark.parametrize("case", list(NEW_TERMS))
def test_new_losses_and_terms_are_microbatch_invariant(mode, case):
    from grpolab.core import compute_entropy

    loss_type, options, extras = NEW_TERMS[case]
    torch.manual_seed(0)
    B, T, V = 8, 6, 5
    base = torch.randn(B, T, V, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T))
    mask = torch.arange(T)[None, :] < torch.tensor([1, 6, 3, 2, 5, 4, 6, 1])[:, None]
    adv = torch.randn(B, dtype=torch.float64)
    old = _policy_log_probs(base + 0.5 * torch.randn_like(base), tokens).detach()
    is_w = torch.rand(B, T, dtype=torch.float64) * 2

    def grad_for(splits, use_global):
        p = base.clone().requires_grad_(True)
        start = 0
        for size in splits:
            sl = slice(start, start + size)
            start += size
            lp = _policy_log_probs(p[sl], tokens[sl])
            extra = {}
            if extras:
                extra = {"token_entropy": compute_entropy(p[sl]), "entropy_coef": 0.05, "is_weights": is_w[sl]}
            if use_global:
                extra.update(global_num_tokens=mask.sum(), global_batch_size=B)
            grpo_microbatch_train_step(
                lp, mask[sl], len(splits), loss_type, advantages=adv[sl], old_log_probs=old[sl], cliprange=0.2,
                length_normalization=mode, normalize_constant=float(T), loss_options=options, **extra,
            )
        return p.grad

    full = grad_for([B], mode == "token_mean")
    assert full.abs().sum() > 0
    if mode != "token_mean":
        assert torch.allclose(grad_for([2, 2, 2, 2], False), full, atol=1e-6)
    assert torch.allclose(grad_for([1, 4, 3], True), full, atol=1e-6)
