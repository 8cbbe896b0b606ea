"""grpolab.core.importance: sampler/trainer IS weights (TIS / MIS, token / sequence), applied by the train step."""

import math

import pytest
import torch

from grpolab.core import (
    IS_LEVELS,
    IS_MODES,
    grpo_microbatch_train_step,
    importance_sampling_weights,
)


def _batch():
    """trainer - sampler log-ratios: row 0 ratios 1.5, 3, 0.25 (sequence 1.125); row 1 ratios 4, 2 and a
    padding token (sequence 8); row 2 empty. Padding holds values that would change every figure."""
    ratios = torch.tensor([[1.5, 3.0, 0.25], [4.0, 2.0, 100.0], [50.0, 50.0, 50.0]])
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0], [-1.0, -1.0, -1.0]])
    trainer = (sampler + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    return trainer, sampler, mask


def _stats(stats):
    return [stats["is_ratio_mean"].item(), stats["is_ratio_max"].item(), stats["is_truncated_fraction"].item()]


def test_token_level_tis_and_mis_by_hand():
    trainer, sampler, mask = _batch()
    w, stats = importance_sampling_weights(trainer, sampler, mask, mode="tis", level="token", cap=2.0)
    assert not w.requires_grad
    assert w.flatten().tolist() == pytest.approx([1.5, 2.0, 0.25, 2.0, 2.0, 0, 0, 0, 0], rel=1e-6)
    # before truncation: 5 tokens, ratios 1.5 3 .25 4 2 -> mean 10.75/5, max 4; capped (> 2): 3 and 4
    assert _stats(stats) == pytest.approx([2.15, 4.0, 2 / 5], rel=1e-6)
    w, stats = importance_sampling_weights(trainer, sampler, mask, mode="mis", level="token", cap=2.0)
    # kept where 1/2 <= ratio <= 2 (2 is inside), else 0
    assert w.flatten().tolist() == pytest.approx([1.5, 0, 0, 0, 2.0, 0, 0, 0, 0], rel=1e-6)
    assert _stats(stats) == pytest.approx([2.15, 4.0, 3 / 5], rel=1e-6)


def test_sequence_product_level_tis_and_mis_by_hand():
    trainer, sampler, mask = _batch()
    w, stats = importance_sampling_weights(trainer, sampler, mask, mode="tis", level="sequence_product", cap=2.0)
    # sequence ratios: 1.5 * 3 * 0.25 = 1.125 and 4 * 2 = 8 (capped to 2), broadcast to each response token
    assert w.flatten().tolist() == pytest.approx([1.125] * 3 + [2.0, 2.0, 0] + [0] * 3, rel=1e-6)
    # over the 2 non-empty sequences: mean (1.125 + 8) / 2, max 8, capped 1 of 2
    assert _stats(stats) == pytest.approx([4.5625, 8.0, 0.5], rel=1e-6)
    w, stats = importance_sampling_weights(trainer, sampler, mask, mode="mis", level="sequence_product", cap=2.0)
    assert w.flatten().tolist() == pytest.approx([1.125] * 3 + [0] * 6, rel=1e-6)
    assert _stats(stats) == pytest.approx([4.5625, 8.0, 0.5], rel=1e-6)


def _reference(trainer, sampler, mask, level, mode, cap, low=None, high=None):
    """Float64 weights computed one response at a time, in plain Python."""
    out = torch.zeros(trainer.shape, dtype=torch.float64)
    for b in range(trainer.shape[0]):
        idx = [t for t in range(trainer.shape[1]) if mask[b, t]]
        logs = [float(trainer[b, t]) - float(sampler[b, t]) for t in idx]
        if not idx:
            continue
        if level == "sequence":  # geometric mean of the token ratios
            rho = [math.exp(sum(logs) / len(logs))] * len(idx)
        elif level == "sequence_product":
            rho = [math.exp(sum(logs))] * len(idx)
        else:
            rho = [math.exp(x) for x in logs]
        for t, r, x in zip(idx, rho, logs):
            w = min(r, cap) if mode == "tis" else (r if 1 / cap <= r <= cap else 0.0)
            if (low is not None and math.exp(x) < low) or (high is not None and math.exp(x) > high):
                w = 0.0
            out[b, t] = w
    return out


@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("band", [(None, None), (0.5, 2.0), (None, 1.2)])
def test_weights_equal_a_float64_reference(level, mode, band):
    gen = torch.Generator().manual_seed(0)
    sampler = -torch.rand(5, 9, generator=gen, dtype=torch.float64) * 3
    trainer = sampler + torch.randn(5, 9, generator=gen, dtype=torch.float64) * 0.4
    mask = torch.rand(5, 9, generator=gen) < 0.7
    mask[4] = False  # an empty response
    w, stats = importance_sampling_weights(trainer, sampler, mask, mode=mode, level=level, cap=1.5,
                                           mask_low=band[0], mask_high=band[1])
    assert w.dtype == torch.float64
    assert torch.allclose(w, _reference(trainer, sampler, mask, level, mode, 1.5, *band), rtol=1e-12, atol=0)
    assert ("is_band_masked_fraction" in stats) == (band != (None, None))


def test_a_long_responses_sequence_weight_does_not_collapse_with_its_length():
    """4000 tokens, each at log-ratio -0.0007 (a bf16-sized mismatch): the product of the token ratios
    is exp(-2.8) = 0.061, which TIS/MIS would read as a wildly off-policy response; the geometric
    mean stays exp(-0.0007) = 0.9993, as a 10-token response with the same per-token mismatch."""
    sampler = torch.full((2, 4000), -1.0)
    trainer = sampler - 0.0007
    mask = torch.ones(2, 4000, dtype=torch.bool)
    mask[1, 10:] = False
    geo, _ = importance_sampling_weights(trainer, sampler, mask, mode="mis", level="sequence", cap=2.0)
    prod, prod_stats = importance_sampling_weights(trainer, sampler, mask, mode="mis", level="sequence_product",
                                                   cap=2.0)
    assert geo[0, 0].item() == pytest.approx(math.exp(-0.0007), rel=1e-6)
    assert geo[0, 0].item() == pytest.approx(geo[1, 0].item(), rel=1e-6)  # length-invariant
    assert prod_stats["is_ratio_mean"].item() == pytest.approx((math.exp(-2.8) + math.exp(-0.007)) / 2, rel=1e-4)
    assert prod[0].abs().sum().item() == 0  # the product (0.061 < 1/2) drops the long response entirely


def test_icepop_band_masks_tokens_outside_it_at_every_level():
    trainer, sampler, mask = _batch()  # token ratios 1.5, 3, .25 | 4, 2
    w, stats = importance_sampling_weights(trainer, sampler, mask, mode="tis", level="token", cap=10.0,
                                           mask_low=0.5, mask_high=2.0)
    assert w.flatten().tolist() == pytest.approx([1.5, 0, 0, 0, 2.0, 0, 0, 0, 0], rel=1e-6)
    assert stats["is_band_masked_fraction"].item() == pytest.approx(3 / 5)
    w, _ = importance_sampling_weights(trainer, sampler, mask, mode="tis", level="sequence", cap=10.0,
                                       mask_low=0.5, mask_high=2.0)
    geo0, geo1 = 1.125 ** (1 / 3), 8 ** (1 / 2)
    assert w.flatten().tolist() == pytest.approx([geo0, 0, 0, 0, geo1, 0, 0, 0, 0], rel=1e-6)


def test_bad_arguments():
    trainer, sampler, mask = _batch()
    assert IS_MODES == ("tis", "mis") and IS_LEVELS == ("token", "sequence", "sequence_product")
    with pytest.raises(ValueError, match="mode 'clip'"):
        importance_sampling_weights(trainer, sampler, mask, mode="clip")
    with pytest.raises(ValueError, match="level 'batch'"):
        importance_sampling_weights(trainer, sampler, mask, level="batch")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        importance_sampling_weights(trainer, sampler, mask, cap=0.5)
    with pytest.raises(ValueError, match="mask_low must be in"):
        importance_sampling_weights(trainer, sampler, mask, mask_low=1.5)
    with pytest.raises(ValueError, match="mask_high must be >= 1"):
        importance_sampling_weights(trainer, sampler, mask, mask_high=0.5)


def test_train_step_multiplies_the_policy_gradient_term_only():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    m = torch.tensor([[True, True]])
    w = torch.tensor([[2.0, 0.5]], requires_grad=True)
    loss, _ = grpo_microbatch_train_step(lp, m, 1, "reinforce_with_baseline", advantages=torch.tensor([1.0]),
                                         is_weights=w)
    # per token -A * lp * w = [2, 1] -> masked mean 1.5; d/dlp = -w / 2
    assert loss.item() == pytest.approx(1.5)
    assert lp.grad[0].tolist() == pytest.approx([-1.0, -0.25])
    assert w.grad is None  # used detached
    # the KL term is not reweighted: with A = 0 and zero weights, the k2 gradient remains
    lp.grad = None
    ref = torch.tensor([[-1.5, -1.0]])
    grpo_microbatch_train_step(lp, m, 1, "reinforce_with_baseline", advantages=torch.tensor([0.0]),
                               is_weights=torch.zeros(1, 2), ref_log_probs=ref, kl_coef=0.5, kl_estimator_name="k2")
    assert lp.grad[0].tolist() == pytest.approx([0.5 * 0.5 / 2, 0.5 * -1.0 / 2])
