"""grpolab.core.registry: registration, look-up and name listing."""

import pytest
import torch

from grpolab.core import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    advantage_estimator_names,
    compute_advantages,
    get_advantage_estimator,
    get_policy_loss,
    grpo_advantages,
    policy_loss_names,
    register_advantage_estimator,
    register_policy_loss,
    unregister_advantage_estimator,
    unregister_policy_loss,
)

BUILTIN_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")


def test_names_are_tuples_in_registration_order():
    assert advantage_estimator_names() == BUILTIN_ESTIMATORS
    assert isinstance(policy_loss_names(), tuple) and policy_loss_names()[0] == "no_baseline"
    assert tuple(POLICY_LOSSES) == policy_loss_names()
    assert tuple(ADVANTAGE_ESTIMATORS) == advantage_estimator_names()
    assert get_advantage_estimator("grpo") is grpo_advantages


def test_register_and_unregister_an_advantage_estimator():
    @register_advantage_estimator("loo_mean")
    def leave_one_out(raw_rewards, group_size, **options):
        grouped = raw_rewards.view(-1, group_size)
        baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
        return (grouped - baseline).reshape(-1)

    try:
        assert advantage_estimator_names() == BUILTIN_ESTIMATORS + ("loo_mean",)
        adv = compute_advantages("loo_mean", torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), 3, advantage_eps=0.0)
        assert torch.allclose(adv, torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("loo_mean")(leave_one_out)
        replacement = register_advantage_estimator("loo_mean", replace=True)(lambda r, g, **o: r * 0)
        assert get_advantage_estimator("loo_mean") is replacement
    finally:
        unregister_advantage_estimator("loo_mean")
    assert advantage_estimator_names() == BUILTIN_ESTIMATORS
    with pytest.raises(ValueError, match="unknown advantage estimator 'loo_mean'; expected one of grpo, rloo, "):
        unregister_advantage_estimator("loo_mean")


def test_replace_keeps_the_builtin_recoverable():
    original = get_policy_loss("no_baseline")
    try:
        register_policy_loss("no_baseline", replace=True)(lambda lp, **kw: (lp * 0, {}))
        assert get_policy_loss("no_baseline") is not original
    finally:
        register_policy_loss("no_baseline", replace=True)(original)
    assert get_policy_loss("no_baseline") is original


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_names_are_rejected(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        register_policy_loss(bad)
    with pytest.raises(ValueError, match="non-empty string"):
        register_advantage_estimator(bad)


def test_non_callables_are_rejected():
    with pytest.raises(TypeError, match="callable"):
        register_policy_loss("not_a_function")(42)
    assert "not_a_function" not in policy_loss_names()


def test_unregistering_an_unknown_loss_lists_the_registered_names():
    with pytest.raises(ValueError, match="unknown loss_type 'nope'; expected one of no_baseline, "):
        unregister_policy_loss("nope")
