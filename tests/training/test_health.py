"""grpolab.training.health: the per-step health figures and the diagnoses they trigger."""

import pytest
import torch

from grpolab.training.health import HealthMonitor, UnhealthyRunError, rollout_health

HEALTHY = dict(zero_variance_group_fraction=0.25, reward_mean=0.5, truncation_rate=0.0, format_failure_rate=0.0,
               reward_errors=0, logprob_mismatch=0.0)


def figures(**kw):
    return {**HEALTHY, **kw}


def run_steps(monitor, steps):
    """The messages of each step."""
    return [monitor.update(m) for m in steps]


def test_a_healthy_run_says_nothing():
    assert run_steps(HealthMonitor(window=2), [figures()] * 5) == [[]] * 5


@pytest.mark.parametrize("reward_mean,expected,not_expected", [
    (0.0, "every response in every group scored 0", "identical rewards"),
    (1.0, "every group got identical rewards", "scored 0"),
])
def test_zero_variance_diagnosis_depends_on_the_reward(reward_mean, expected, not_expected):
    monitor = HealthMonitor(window=3)
    out = run_steps(monitor, [figures(zero_variance_group_fraction=1.0, reward_mean=reward_mean)] * 5)
    assert out[0] == [] and out[1] == []  # only after `window` consecutive steps
    assert len(out[2]) == 1 and out[2][0].startswith("No learning signal for 3 steps")
    assert expected in out[2][0] and not_expected not in out[2][0]
    assert out[3] == [] and out[4] == []  # reported once


def test_a_broken_streak_starts_again():
    bad = figures(zero_variance_group_fraction=1.0)
    monitor = HealthMonitor(window=3)
    out = run_steps(monitor, [bad, bad, figures(), bad, bad])
    assert out == [[]] * 5
    assert monitor.update(bad) != []  # the third consecutive one


def test_truncation_diagnosis():
    monitor = HealthMonitor(window=2, truncation_threshold=0.5)
    out = run_steps(monitor, [figures(truncation_rate=0.5)] * 3 + [figures(truncation_rate=0.75)] * 2)
    assert out[:4] == [[]] * 4  # at the threshold is not above it
    assert len(out[4]) == 1 and "75% of responses hit sampling_max_tokens for 2 steps" in out[4][0]


def test_format_failure_diagnosis():
    monitor = HealthMonitor(window=2)
    out = run_steps(monitor, [figures(format_failure_rate=0.99), figures(format_failure_rate=1.0),
                              figures(format_failure_rate=1.0)])
    assert out[:2] == [[], []] and "Format success has been 0 for 2 steps" in out[2][0]


def test_reward_errors_are_reported_at_once_with_the_last_error():
    monitor = HealthMonitor(window=5)
    out = monitor.update(figures(reward_errors=3, last_reward_error="ZeroDivisionError: boom"))
    assert len(out) == 1 and "failed on 3 responses" in out[0] and "ZeroDivisionError: boom" in out[0]
    assert monitor.update(figures(reward_errors=1)) == []


def test_logprob_mismatch_is_reported_at_once_above_the_threshold():
    monitor = HealthMonitor(window=5, logprob_mismatch_threshold=0.05)
    assert monitor.update(figures(logprob_mismatch=0.05)) == []
    out = monitor.update(figures(logprob_mismatch=0.2))
    assert len(out) == 1 and "0.200 nats" in out[0]


def test_several_problems_in_one_step():
    monitor = HealthMonitor(window=1)
    out = monitor.update(figures(zero_variance_group_fraction=1.0, reward_mean=0.0, truncation_rate=1.0,
                                 format_failure_rate=1.0, reward_errors=1, logprob_mismatch=1.0))
    assert len(out) == 5


def test_stop_on_unhealthy_raises_with_the_diagnosis():
    monitor = HealthMonitor(window=2, stop_on_unhealthy=True)
    monitor.update(figures(format_failure_rate=1.0))
    with pytest.raises(UnhealthyRunError, match="Format success has been 0"):
        monitor.update(figures(format_failure_rate=1.0))


def test_stop_on_named_problems_stops_only_on_those():
    """A list stops on the problems it names and only reports the others (the demos stop on
    ``zero_variance``: no group with a right answer, nothing to learn from)."""
    monitor = HealthMonitor(window=1, stop_on_unhealthy=("zero_variance",))
    out = monitor.update(figures(format_failure_rate=1.0, truncation_rate=1.0))
    assert len(out) == 2  # reported, the run goes on
    with pytest.raises(UnhealthyRunError, match="No learning signal") as stopped:
        monitor.update(figures(zero_variance_group_fraction=1.0, reward_mean=0.0, reward_errors=1))
    assert "failed on 1 responses" not in str(stopped.value)  # only the named problem's diagnosis stops it


def test_state_round_trip_keeps_streaks_so_a_resumed_monitor_fires_at_the_same_step():
    bad = figures(zero_variance_group_fraction=1.0)
    steps = [bad] * 6 + [figures(reward_errors=1)] * 2
    uninterrupted = run_steps(HealthMonitor(window=4), steps)
    first = HealthMonitor(window=4)
    head = run_steps(first, steps[:3])
    resumed = HealthMonitor(window=4)
    resumed.load_state_dict(first.state_dict())
    assert head + run_steps(resumed, steps[3:]) == uninterrupted
    assert [bool(m) for m in uninterrupted] == [False, False, False, True, False, False, True, False]
    # what was reported survives too: a diagnosis made before the checkpoint is not made again
    again = HealthMonitor(window=4)
    again.load_state_dict(resumed.state_dict())
    assert run_steps(again, [bad] * 5) == [[]] * 5
    # a fresh monitor (no state) would start its streak from zero
    assert run_steps(HealthMonitor(window=4), steps[3:6]) == [[]] * 3


def test_rollout_health_figures():
    raw = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # group size 2: groups (1,1) (0,1) (0,0)
    fmt = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    ans = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    sampler = torch.tensor([[0.0, -1.0, -2.0]] * 6)
    trainer = sampler + torch.tensor([[0.0, 0.1, 0.3]])
    checked = torch.zeros(6, 3, dtype=torch.bool)
    checked[:, 1] = True
    checked[0, 2] = True
    h = rollout_health(raw, 2, ["stop", "length", "eos", "length", "stop", "stop"], fmt, ans, sampler, trainer, checked)
    assert h["zero_variance_group_fraction"] == pytest.approx(2 / 3)
    assert h["truncation_rate"] == pytest.approx(2 / 6)
    assert h["format_failure_rate"] == pytest.approx(1 / 6)
    assert h["wrong_answer_rate"] == pytest.approx(
        2 / 6
    )  # formatted but wrong: rows 2 and 5 (row 4 is a format failure)
    assert h["logprob_mismatch"] == pytest.approx((6 * 0.1 + 0.3) / 7, rel=1e-5)
    assert h["logprob_mismatch_tokens"] == 7
    # nothing measured (no row trained, no old log-probs): no figure, never a vacuous "perfect" 0.0
    none_checked = rollout_health(raw, 2, ["stop"] * 6, fmt, ans, sampler, trainer, torch.zeros(6, 3, dtype=torch.bool))
    assert "logprob_mismatch" not in none_checked and none_checked["logprob_mismatch_tokens"] == 0
    assert HealthMonitor(window=1).update({k: v for k, v in HEALTHY.items() if k != "logprob_mismatch"}) == []


def test_reward_answer_agreement_counts_right_over_wrong_pairs_within_groups():
    from grpolab.training.health import reward_answer_agreement
    ans = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # group size 4: (R W W R) (R W W W)
    # the answer check itself as the reward: every right answer above every wrong one
    assert reward_answer_agreement(ans, ans, 4) == {"reward_answer_agreement": 1.0, "reward_answer_pairs": 4 + 3}
    # a reward that prefers wrong answers in group 1 and ties in group 2
    raw = torch.tensor([0.1, 0.9, 0.2, 0.3, 0.5, 0.5, 0.5, 0.5])
    # group 1 pairs (right i, wrong j): (0,1) no, (0,2) no, (3,1) no, (3,2) yes -> 1 of 4; group 2: three ties -> 1.5
    assert reward_answer_agreement(raw, ans, 4)["reward_answer_agreement"] == pytest.approx((1 + 1.5) / 7)
    # pairs never cross groups: right answers only in one group, wrong only in the other -> no pair, no figure
    assert reward_answer_agreement(raw, torch.tensor([1.0] * 4 + [0.0] * 4), 4) == {}
    h = rollout_health(raw, 4, ["stop"] * 8, torch.ones(8), ans, torch.zeros(8, 1), torch.zeros(8, 1),
                       torch.ones(8, 1, dtype=torch.bool))
    assert h["reward_answer_agreement"] == pytest.approx(2.5 / 7) and h["reward_answer_pairs"] == 7
    # answer rewards that are the reward itself (no answer check of their own): no figure
    unjudged = rollout_health(raw, 4, ["stop"] * 8, torch.ones(8), ans, torch.zeros(8, 1), torch.zeros(8, 1),
                              torch.ones(8, 1, dtype=torch.bool), answer_checked=False)
    assert "reward_answer_agreement" not in unjudged and "reward_answer_pairs" not in unjudged


def test_a_reward_that_prefers_wrong_answers_is_reported_as_possible_hacking():
    monitor = HealthMonitor(window=3)
    hacked = [figures(reward_answer_agreement=0.3)] * 3
    messages = run_steps(monitor, hacked)
    assert messages[:2] == [[], []] and len(messages[2]) == 1
    assert "wrong answer above a right one in 70%" in messages[2][0] and "kl_coef" in messages[2][0]
    # an agreeing reward, a streak broken by one agreeing step, or no (right, wrong) pair: nothing
    assert run_steps(HealthMonitor(window=3), [figures(reward_answer_agreement=0.8)] * 5) == [[]] * 5
    broken = [figures(reward_answer_agreement=a) for a in (0.3, 0.3, 0.6, 0.3, 0.3)]
    assert run_steps(HealthMonitor(window=3), broken) == [[]] * 5
    assert run_steps(HealthMonitor(window=3), [figures()] * 5) == [[]] * 5
    # a step with no (right, wrong) pair (every answer wrong: where hacking ends) neither breaks nor extends the streak
    gap = [figures(reward_answer_agreement=0.3), figures(reward_answer_agreement=0.3), figures(),
           figures(reward_answer_agreement=0.3)]
    assert [len(m) for m in run_steps(HealthMonitor(window=3), gap)] == [0, 0, 0, 1]
    with pytest.raises(UnhealthyRunError, match="reward disagrees"):
        run_steps(HealthMonitor(window=1, stop_on_unhealthy=("reward_disagreement",)), hacked)
