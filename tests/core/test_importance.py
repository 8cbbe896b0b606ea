"""grpolab.core.importance: sampler/trainer IS weights (TIS / MIS, token / sequence), applied by the train step."""


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


def test_sequence_level_tis_and_mis_by_hand():
    trainer, sampler, mask = _batch()
    w, stats = importance_sampling_weights(trainer, sampler, mask, mode="tis", level="sequence", cap=2.0)
    # sequence ratios: 1.5 * 3 * 0.25 = 1.125 and 4 * 2 = 8 (capped to 2), broadcast to each response token
    assert w.flatten().tolist() == pytest.approx([1.125] * 3 + [2.0, 2.0, 0] + [0] * 3, rel=1e-6)
    # over the 2 non-empty sequences: mean (1.125 + 8) / 2, max 8, capped 1 of 2
    assert _stats(stats) == pytest.approx([4.5625, 8.0, 0.5], rel=1e-6)
    w, stats = importance_sampling_weights(trainer, sampler, mask, mode="mis", level="sequence", cap=2.0)
    assert w.flatten().tolist() == pytest.approx([1.125] * 3 + [0] * 6, rel=1e-6)
    assert _stats(stats) == pytest.approx([4.5625, 8.0, 0.5], rel=1e-6)


def test_bad_arguments():
    trainer, sampler, mask = _batch()
    assert IS_MODES == ("tis", "mis") and IS_LEVELS == ("token", "sequence")
    with pytest.raises(ValueError, match="mode 'clip'"):
        importance_sampling_weights(trainer, sampler, mask, mode="clip")
    with pytest.raises(ValueError, match="level 'batch'"):
        importance_sampling_weights(trainer, sampler, mask, level="batch")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        importance_sampling_weights(trainer, sampler, mask, cap=0.5)


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
