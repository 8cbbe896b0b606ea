"""``max_staleness`` bounded by the run (reliability probe, turn 5, A05): a staleness as long as the
run or longer was accepted without a word, and every batch was then sampled by the starting weights."""

from __future__ import annotations

import pytest

from grpolab.algorithms.grpo import GRPOConfig


@pytest.mark.parametrize("k, steps", [(1000, 2), (3, 3), (2, 1)])
def test_A05_a_staleness_as_long_as_the_run_is_one_line(k, steps):
    with pytest.raises(ValueError, match=rf"max_staleness {k} is not below n_grpo_steps {steps}: .* use at most"):
        GRPOConfig(max_staleness=k, n_grpo_steps=steps)


@pytest.mark.parametrize("k, steps", [(1, 1), (1, 2), (2, 3)])
def test_A05_a_staleness_shorter_than_the_run_is_accepted(k, steps):
    assert GRPOConfig(max_staleness=k, n_grpo_steps=steps).max_staleness == k
