"""grpolab.core.advantages: the registered estimators "grpo" (scale_rewards), "rloo", "reinforce_plus_plus"."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.core import (
    SCALE_REWARDS,
    compute_advantages,
    normalize_group_rewards,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)

# groups of 2: [1, 0], [3, 3] (zero variance), [2, 0]
REWARDS = torch.tensor([1.0, 0.0, 3.0, 3.0, 2.0, 0.0])


def _close(got, expected, tol=1e-6):
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, abs=tol)


# ---------------------------------------------------------------- grpo: scale_rewards
def test_scale_rewards_group_batch_none_by_hand():
    assert SCALE_REWARDS == ("group", "batch", "none")
    # group std (Bessel, n = 2) of [1, 0] is 1/sqrt(2), of [2, 0] sqrt(2): both give +-1/sqrt(2)
    g = 1 / math.sqrt(2)
    _close(compute_advantages("grpo", REWARDS, 2, advantage_eps=0.0, scale_rewards="group"), [g, -g, 0, 0, g, -g])
    # batch: mean 1.5, squared deviations .25 2.25 2.25 2.25 .25 2.25 = 9.5, / 5 = 1.9
    b = math.sqrt(1.9)
    _close(compute_advantages("grpo", REWARDS, 2, advantage_eps=0.0, scale_rewards="batch"),
           [0.5 / b, -0.5 / b, 0, 0, 1 / b, -1 / b])
    _close(compute_advantages("grpo", REWARDS, 2, scale_rewards="none"), [0.5, -0.5, 0, 0, 1, -1])
    # eps is added to the batch std
    _close(compute_advantages("grpo", REWARDS, 2, advantage_eps=0.1, scale_rewards="batch"),
           [0.5 / (b + 0.1), -0.5 / (b + 0.1), 0, 0, 1 / (b + 0.1), -1 / (b + 0.1)])


def test_scale_rewards_precedence_over_use_std_normalization():
    by_group = normalize_group_rewards(REWARDS, 2, 1e-6, True)
    centred = normalize_group_rewards(REWARDS, 2, 1e-6, False)
    assert torch.equal(compute_advantages("grpo", REWARDS, 2), by_group)  # default: "group"
    assert torch.equal(compute_advantages("grpo", REWARDS, 2, use_std_normalization=False), centred)
    # an explicit scale_rewards wins either way
    assert torch.equal(compute_advantages("grpo", REWARDS, 2, use_std_normalization=False, scale_rewards="group"),
                       by_group)
    assert torch.equal(compute_advantages("grpo", REWARDS, 2, use_std_normalization=True, scale_rewards="none"),
                       centred)
    with pytest.raises(ValueError, match="unknown scale_rewards 'global'; expected one of group, batch, none"):
        compute_advantages("grpo", REWARDS, 2, scale_rewards="global")


@pytest.mark.parametrize("scale", SCALE_REWARDS)
@pytest.mark.parametrize("rewards", [[1.0, 1.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.1, 0.1, 0.7, 0.7]])
def test_zero_variance_groups_are_exactly_zero_in_every_scale(scale, rewards):
    adv = compute_advantages("grpo", torch.tensor(rewards), 2, advantage_eps=0.0, scale_rewards=scale)
    assert torch.equal(adv, torch.zeros(4))


# ---------------------------------------------------------------- rloo
def test_rloo_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0, 3.0, 0.0, 6.0])
    # group 1: 1 - mean(0, 0) = 1, 0 - mean(1, 0) = -0.5 (twice); group 2: 0; group 3: 3 - 3, 0 - 4.5, 6 - 1.5
    _close(compute_advantages("rloo", rewards, 3), [1.0, -0.5, -0.5, 0, 0, 0, 0.0, -4.5, 4.5])
    _close(rloo_advantages(torch.tensor([1.0, 0.0]), 2), [1.0, -1.0])
    assert torch.equal(rloo_advantages(torch.full((4,), 0.3), 2), torch.zeros(4))


def test_rloo_needs_two_per_group():
    with pytest.raises(ValueError, match="rloo.*group_size >= 2"):
        compute_advantages("rloo", torch.tensor([1.0, 0.0]), 1)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 5), st.lists(st.floats(-5, 5, allow_nan=False), min_size=10, max_size=10))
def test_rloo_is_g_over_g_minus_1_times_the_centred_reward(g, values):
    rewards = torch.tensor(values[: (len(values) // g) * g])
    expected = normalize_group_rewards(rewards, g, 0.0, False) * g / (g - 1)
    assert torch.allclose(rloo_advantages(rewards, g), expected, atol=1e-5)


# ---------------------------------------------------------------- reinforce_plus_plus
def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # batch mean 0.25; squared deviations .5625 + 3 * .0625 = .75, / 3 = .25: std 0.5
    _close(compute_advantages("reinforce_plus_plus", rewards, 2, advantage_eps=0.0), [1.5, -0.5, -0.5, -0.5])
    _close(compute_advantages("reinforce_plus_plus", rewards, 2), [0.75 / 0.500001, -0.25 / 0.500001,
                                                                   -0.25 / 0.500001, -0.25 / 0.500001])
    # baseline variant: group-centred [0.5, -0.5, 0, 0]; their batch std sqrt(0.5 / 3) = 1/sqrt(6)
    _close(reinforce_plus_plus_advantages(rewards, 2, advantage_eps=0.0, group_baseline=True),
           [0.5 * math.sqrt(6), -0.5 * math.sqrt(6), 0.0, 0.0])


def test_reinforce_plus_plus_degenerate_batches():
    # all equal: zero, not NaN, with or without the group baseline
    for baseline in (False, True):
        adv = reinforce_plus_plus_advantages(torch.full((4,), 0.7), 2, advantage_eps=0.0, group_baseline=baseline)
        assert torch.equal(adv, torch.zeros(4))
    # every group zero-variance: the baseline variant gives exactly 0, the plain one does not
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert torch.equal(reinforce_plus_plus_advantages(rewards, 2, advantage_eps=0.0, group_baseline=True),
                       torch.zeros(4))
    _close(reinforce_plus_plus_advantages(rewards, 2, advantage_eps=0.0), [0.5 * math.sqrt(3)] * 2
           + [-0.5 * math.sqrt(3)] * 2)  # batch std of [1, 1, 0, 0] is sqrt(1/3)
    with pytest.raises(ValueError, match="group_size=3"):
        reinforce_plus_plus_advantages(rewards, 3)
