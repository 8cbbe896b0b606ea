"""grpolab.core.advantages: group-normalised rewards, the "grpo" estimator, GAE."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.core import (
    compute_advantages,
    compute_gae,
    compute_group_normalized_rewards,
    normalize_group_rewards,
)


def _reward_table(response, ground_truth):
    r = float(response == ground_truth)
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


def test_group_normalized_rewards_hand_case():
    responses = ["a", "b", "a", "a", "x", "x"]
    gts = ["a", "a", "a", "x", "x", "x"]
    adv, raw, meta = compute_group_normalized_rewards(_reward_table, responses, gts, 3, 1e-6, True)
    assert raw.dtype == torch.float32 and adv.dtype == torch.float32
    assert raw.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    std = torch.tensor([1.0, 0.0, 1.0]).std().item()  # Bessel: sqrt(1/3)
    assert std == pytest.approx(math.sqrt(1 / 3))
    exp0 = [(1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6), (1 - 2 / 3) / (std + 1e-6)]
    exp1 = [(0 - 2 / 3) / (std + 1e-6), (1 - 2 / 3) / (std + 1e-6), (1 - 2 / 3) / (std + 1e-6)]
    assert adv.tolist() == pytest.approx(exp0 + exp1, rel=1e-6)
    assert meta["reward_mean"] == pytest.approx(4 / 6)
    assert meta["reward_max"] == 1.0 and meta["reward_min"] == 0.0
    assert meta["format_reward_mean"] == 1.0 and meta["answer_reward_mean"] == pytest.approx(4 / 6)
    adv2, _, _ = compute_group_normalized_rewards(_reward_table, responses, gts, 3, 1e-6, False)
    assert adv2.tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3, -2 / 3, 1 / 3, 1 / 3], rel=1e-6)


def test_zero_variance_groups_give_zero_advantage_not_nan():
    adv, _, meta = compute_group_normalized_rewards(_reward_table, ["a"] * 4, ["b"] * 4, 2, 1e-6, True)
    assert torch.equal(adv, torch.zeros(4))
    assert meta["zero_variance_group_fraction"] == 1.0
    adv1, _, _ = compute_group_normalized_rewards(_reward_table, ["a", "b"], ["a", "a"], 1, 1e-6, True)
    assert torch.equal(adv1, torch.zeros(2))


def test_group_normalized_rewards_rejects_ragged_groups():
    with pytest.raises(ValueError, match="group_size"):
        compute_group_normalized_rewards(_reward_table, ["a"] * 5, ["a"] * 5, 2, 1e-6, True)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda g: st.tuples(st.just(g + 1),
                            st.lists(st.floats(-5, 5, allow_nan=False), min_size=g + 1, max_size=g + 1).map(list))
    ),
    st.integers(1, 4),
    st.booleans(),
)
def test_group_advantages_sum_to_zero(group, n_groups, by_std):
    g, rewards = group
    values = rewards * n_groups
    fn = lambda r, gt: {"reward": r}  # noqa: E731
    adv, _, _ = compute_group_normalized_rewards(fn, values, [None] * len(values), g, 1e-6, by_std)
    assert torch.allclose(adv.view(-1, g).sum(1), torch.zeros(n_groups), atol=1e-4)


def _gae_loop(rewards, values, lengths, gamma, lam):
    adv = torch.zeros_like(rewards)
    for b, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            nv = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * nv - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv


def test_gae_matches_reverse_loop_on_ragged_lengths():
    torch.manual_seed(0)
    lengths = [5, 1, 3, 0]
    T = 6
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    rewards = torch.randn(4, T, dtype=torch.float64)
    values = torch.randn(4, T, dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, 0.99, 0.95)
    expected = _gae_loop(rewards, values, lengths, 0.99, 0.95)
    assert torch.allclose(adv, expected)
    assert torch.allclose(ret, (expected + values) * mask)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-3, 3, allow_nan=False), min_size=1, max_size=6), min_size=1, max_size=4))
def test_gae_gamma_lambda_one_zero_values_is_reward_to_go(rows):
    T = max(len(r) for r in rows)
    rewards = torch.zeros(len(rows), T, dtype=torch.float64)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        rewards[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = True
    adv, ret = compute_gae(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)
    rtg = rewards.flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(adv, rtg) and torch.allclose(ret, rtg)



# ---------------------------------------------------------------- zero-variance groups with any eps
@pytest.mark.parametrize("by_std", [True, False])
def test_zero_variance_groups_are_zero_with_eps_zero(by_std):
    responses = ["a", "a", "a", "b", "a", "b", "x", "x", "x"]
    gts = ["b", "b", "b", "b", "b", "a", "x", "x", "x"]  # groups: all 0, mixed, all 1
    adv, raw, meta = compute_group_normalized_rewards(_reward_table, responses, gts, 3, 0.0, by_std)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:3], torch.zeros(3)) and torch.equal(adv[6:], torch.zeros(3))
    mixed = raw[3:6].double()
    expected = mixed - mixed.mean()
    if by_std:
        expected = expected / mixed.std()
    assert torch.allclose(adv[3:6].double(), expected, atol=1e-6)
    assert meta["zero_variance_group_fraction"] == pytest.approx(2 / 3)


@settings(max_examples=60, deadline=None)
@given(
    st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False),
    st.integers(1, 9),
    st.sampled_from([0.0, 1e-6]),
    st.booleans(),
)
def test_constant_group_gives_exact_zero(value, group_size, eps, by_std):
    rewards = torch.full((2 * group_size,), value, dtype=torch.float32)
    rewards[group_size:] = value / 3 + 0.1  # a second constant group with a value that rounds
    adv = normalize_group_rewards(rewards, group_size, eps, by_std)
    assert torch.equal(adv, torch.zeros_like(adv))


# ---------------------------------------------------------------- registered estimators
def test_grpo_estimator_is_normalize_group_rewards_with_cs336_defaults():
    raw = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])
    for eps, by_std in [(1e-6, True), (0.0, True), (0.1, False)]:
        got = compute_advantages("grpo", raw, 3, advantage_eps=eps, use_std_normalization=by_std)
        assert torch.equal(got, normalize_group_rewards(raw, 3, eps, by_std))
    assert torch.equal(compute_advantages("grpo", raw, 3), normalize_group_rewards(raw, 3, 1e-6, True))
    # options an estimator does not use are ignored, so a trainer can pass one set to any estimator
    assert torch.equal(compute_advantages("grpo", raw, 3, gamma=1.0), compute_advantages("grpo", raw, 3))
    assert compute_advantages("grpo", raw, 3).dtype == torch.float32


def test_unknown_advantage_estimator_lists_registered_names():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'vtrace'; expected one of grpo, rloo, "
                                         r"reinforce_plus_plus$"):
        compute_advantages("vtrace", torch.zeros(4), 2)
