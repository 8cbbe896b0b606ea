"""Reward supervision with real subprocesses (no mocks): a reward that hangs, calls ``os._exit`` or
segfaults costs one sample (reward 0, an error with its cause) and the scorer keeps working; the
grader children do not import modules from the working directory."""

import textwrap
import time
import warnings

import pytest

from grpolab.rewards import (
    RewardComponent,
    RewardScorer,
    WeightedReward,
    get_reward_fn,
    is_builtin_reward,
    r1_zero_reward_fn,
    reward_spec,
    shutdown_math_verify,
)

ZERO = {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}

REWARDS = '''
import ctypes, os, time

def hang(response, ground_truth):
    if response == "hang":
        while True:
            pass
    return {"reward": 1.0}

def sleepy(response, ground_truth):
    if response == "hang":
        time.sleep(600)
    return {"reward": 1.0}

def die(response, ground_truth):
    if response == "die":
        os._exit(3)
    return {"reward": 1.0}

def segfault(response, ground_truth):
    if response == "segv":
        ctypes.string_at(0)
    return {"reward": 1.0}

def noisy(response, ground_truth):
    print("a reward that prints must not corrupt the worker protocol")
    return {"reward": float(response == ground_truth), "pid": float(os.getpid())}
'''


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    """``sup_rewards`` on the path of this process (and so of the worker, which gets our path)."""
    (tmp_path / "sup_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "sup_rewards"


def r1(answer):
    return f"r</think> <answer>{answer}</answer>"


@pytest.mark.slow  # make test-slow (test-all), not make test: minutes of real processes
def test_hanging_reward_times_out_and_the_scorer_stays_usable(rewards_module):
    for name in ("hang", "sleepy"):  # a busy loop and a blocking call: both killed
        with RewardScorer(f"{rewards_module}:{name}", timeout_s=1.0) as scorer:
            assert scorer.mode == "process"
            scorer.score(["warm"], [None])  # start-up (imports) is not part of any item's time
            out = scorer.score(["a", "hang", "b"], [None] * 3)  # "hang" never returns: cut at the timeout
            assert [o["reward"] for o in out] == [1.0, 0.0, 1.0] and out[1] == ZERO
            assert scorer.errors == 1 and scorer.timeouts == 1 and "timed out after 1.0s" in scorer.last_error
            assert [o["reward"] for o in scorer.score(["c", "d"], [None, None])] == [1.0, 1.0]
            assert scorer.errors == 1


@pytest.mark.parametrize("name,trigger,cause", [("die", "die", "exit code 3"), ("segfault", "segv", "SIGSEGV")])
@pytest.mark.slow  # make test-slow (test-all), not make test: minutes of real processes
def test_a_dying_reward_is_an_error_event_not_the_end(rewards_module, name, trigger, cause):
    scorer = RewardScorer(f"{rewards_module}:{name}", timeout_s=10.0)
    out = scorer.score(["a", trigger, "b", trigger], [None] * 4)
    assert [o["reward"] for o in out] == [1.0, 0.0, 1.0, 0.0]
    assert scorer.errors == 2 and scorer.worker_deaths == 2
    assert "reward worker died" in scorer.last_error and cause in scorer.last_error
    assert [o["reward"] for o in scorer.score(["c"], [None])] == [1.0]  # the next batch still scores
    scorer.close()


@pytest.mark.slow  # make test-slow (test-all), not make test: minutes of real processes
def test_restarts_are_capped_per_batch(rewards_module):
    with RewardScorer(f"{rewards_module}:die", timeout_s=10.0, max_restarts=2) as scorer:
        out = scorer.score(["die"] * 20, [None] * 20)
        assert all(o == ZERO for o in out) and scorer.errors == 20
        assert "max_restarts=2" in scorer.last_error and scorer.worker_deaths <= 3  # not one restart per item
        assert scorer.score(["ok"], [None])[0]["reward"] == 1.0


def test_workers_split_a_batch_and_printing_is_harmless(rewards_module):
    with RewardScorer(f"{rewards_module}:noisy", timeout_s=10.0, num_workers=2) as scorer:
        out = scorer.score(list("abcdef"), list("abxdxf"))
        assert [o["reward"] for o in out] == [1, 1, 0, 1, 0, 1]
        assert len({o["pid"] for o in out}) == 2  # two worker processes shared the batch
        assert scorer.errors == 0


def test_where_each_kind_of_reward_runs(rewards_module):
    import sup_rewards

    assert RewardScorer(r1_zero_reward_fn).mode == "builtin"  # pure and bounded: in-process
    assert RewardScorer(get_reward_fn("countdown")).mode == "builtin"
    assert RewardScorer(r1_zero_reward_fn, num_workers=2).mode == "process"
    assert RewardScorer(sup_rewards.noisy).mode == "process"  # the default scorer supervises user code
    with pytest.warns(RuntimeWarning, match="runs in the trainer's process"):
        scorer = RewardScorer(lambda r, g: {"reward": 1.0}, timeout_s=1.0)
    assert scorer.mode == "thread" and scorer.score(["x"], [None]) == [{"reward": 1.0}]
    with pytest.raises(ValueError, match="isolation"):
        RewardScorer(r1_zero_reward_fn, isolation="sandbox")


def test_thread_fallback_still_times_out(rewards_module):
    def closure(response, ground_truth):
        if response == "hang":
            time.sleep(3)
        return {"reward": 1.0}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with RewardScorer(closure, timeout_s=1.5) as scorer:  # ample for the quick items on a busy machine
            out = scorer.score(["a", "hang", "b"], [None] * 3)
    assert [o["reward"] for o in out] == [1.0, 0.0, 1.0] and scorer.timeouts == 1


def test_reward_spec_names_what_a_worker_can_rebuild(rewards_module):
    import sup_rewards

    assert reward_spec(r1_zero_reward_fn) == "r1_zero"
    assert reward_spec(get_reward_fn("r1_zero_lenient")) == "r1_zero_lenient"
    assert reward_spec(sup_rewards.die) == "sup_rewards:die"
    assert reward_spec(lambda r, g: {}) is None
    weighted = WeightedReward([RewardComponent("r1_zero", 0.1, "format_reward"), RewardComponent(sup_rewards.noisy)])
    assert reward_spec(weighted) == [
        {"fn": "r1_zero", "weight": 0.1, "key": "format_reward", "name": None},
        {"fn": "sup_rewards:noisy", "weight": 1.0, "key": "reward", "name": None},
    ]
    assert not is_builtin_reward(weighted) and is_builtin_reward(WeightedReward([RewardComponent("gsm8k")]))
    with RewardScorer(weighted, timeout_s=10.0) as scorer:  # rebuilt from its spec in the worker
        assert scorer.mode == "process"
        out = scorer.score([r1("5"), r1("4")], ["5", "5"])
        assert [o["reward"] for o in out] == [0.1, 0.1] and scorer.errors == 0


def test_a_reward_the_worker_cannot_import_falls_back_with_a_warning():
    import sys
    import types

    ghost = types.ModuleType("ghost_rewards_module")  # importable here (sys.modules), not in a child

    def fn(response, ground_truth):
        return {"reward": 2.0}

    fn.__module__, fn.__qualname__ = ghost.__name__, "fn"
    ghost.fn = fn
    sys.modules[ghost.__name__] = ghost
    try:
        scorer = RewardScorer(fn, timeout_s=5.0)
        assert scorer.mode == "process"
        with pytest.warns(RuntimeWarning, match="could not load it"):
            assert scorer.score(["x"], [None]) == [{"reward": 2.0}]
        assert scorer.mode == "thread" and scorer.errors == 0
        scorer.close()
    finally:
        del sys.modules[ghost.__name__]


# ---------------------------------------------------------------- no code from the working directory
SHADOW = '''
import pathlib
pathlib.Path(__file__).resolve().parents[1].joinpath("MARKER").write_text("imported from the cwd")
raise ImportError("the cwd's math_verify was imported")
'''


@pytest.fixture
def hostile_cwd(tmp_path, monkeypatch):
    """A working directory holding a ``math_verify/`` package that leaves a marker when imported."""
    (tmp_path / "math_verify").mkdir()
    (tmp_path / "math_verify" / "__init__.py").write_text(SHADOW)
    monkeypatch.chdir(tmp_path)
    shutdown_math_verify()  # the next comparison starts a worker here
    yield tmp_path
    shutdown_math_verify()


def test_math_verify_worker_does_not_import_from_the_cwd(hostile_cwd):
    answer = r1("\\frac{\\sqrt{2}}{2}")  # not a plain number: needs math-verify
    assert r1_zero_reward_fn(answer, "\\sqrt{2}/2")["reward"] == 1.0
    assert r1_zero_reward_fn(answer, "\\sqrt{3}/2")["reward"] == 0.0
    assert not (hostile_cwd / "MARKER").exists()


def test_user_reward_worker_finds_the_users_module_in_the_cwd_but_not_shadows(hostile_cwd, monkeypatch):
    (hostile_cwd / "cwd_rewards.py").write_text(textwrap.dedent('''
        def uses_math_verify(response, ground_truth):
            import math_verify  # must be the installed one, not ./math_verify
            from grpolab.rewards import r1_zero_reward_fn
            return r1_zero_reward_fn(response, ground_truth)
    '''))
    monkeypatch.syspath_prepend(str(hostile_cwd))  # as "python -m ..." run from this folder would
    with RewardScorer("cwd_rewards:uses_math_verify", timeout_s=30.0) as scorer:
        assert scorer.mode == "process"
        out = scorer.score([r1("\\frac{\\sqrt{2}}{2}"), r1("2")], ["\\sqrt{2}/2", "\\sqrt{2}/2"])
        assert scorer.last_error is None and [o["reward"] for o in out] == [1.0, 0.0]
    assert not (hostile_cwd / "MARKER").exists()
