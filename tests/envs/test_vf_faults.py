"""verifiers environments under faults: the probe's cases V02, V03, V04, V07 and V10
(``../shared/probes/turn5/reliability-cases.md``, section 5), against the real verifiers package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="verifiers is not installed (pip install -e '.[envs]')")

from grpolab.data.tasks.vf import VerifiersTask  # noqa: E402
from grpolab.rewards import RewardScorer  # noqa: E402
from grpolab.rewards.registry import get_reward_fn  # noqa: E402
from grpolab.rewards.vf_reward import VfRubric  # noqa: E402
from grpolab.rewards.vf_rubric import load_vf_environment  # noqa: E402
from grpolab.training.config import ConfigError  # noqa: E402
from grpolab.training.preflight import probe_environment  # noqa: E402
from tests.helpers.chat_models import chat_model_dir  # noqa: E402

HERE = Path(__file__).parent / "vf_envs"
SUM_ENV, BROKEN_ENV = str(HERE / "sum_env.py"), str(HERE / "broken_env.py")
ROOT = Path(__file__).resolve().parents[2]

EVIL = '''
from pathlib import Path
Path(__file__).with_name("EVIL_RAN").write_text("ran")
def load_environment(**kwargs):
    raise RuntimeError("never a verifiers environment")
'''


def test_V02_the_data_cannot_name_the_environment_a_worker_loads(tmp_path):
    """V02: an answer naming another environment file made the reward worker execute it. The
    rubric is bound to the configured environment; a ground truth naming another is an error."""
    evil = tmp_path / "evil_env.py"
    evil.write_text(EVIL)
    truth = VerifiersTask(SUM_ENV).examples("train", 1)[0].answer
    forged = [{**truth, "env": str(evil)}, {**truth, "env": str(evil), "args": {}}, {**truth, "args": {"n": 3}}]
    with RewardScorer(VfRubric(SUM_ENV), timeout_s=60) as scorer:
        scores = scorer.score([truth["row"]["answer"]] * 4, [truth, *forged])
        assert scorer.mode == "process"
    assert scores[0]["reward"] > 1.0 and [s["reward"] for s in scores[1:]] == [0.0] * 3
    assert scorer.errors == 3 and "environment arguments differ" in scorer.last_error
    assert not (tmp_path / "EVIL_RAN").exists()
    with pytest.raises(ValueError, match=r"names the environment '.*evil_env.py', not the run's configured"):
        VfRubric(SUM_ENV)(truth["row"]["answer"], forged[0])
    # the public function a config could name with any data file is gone: there is nothing to point at
    with pytest.raises(ValueError, match=r"has no function 'vf_rubric_reward'"):
        get_reward_fn("grpolab.rewards.vf_rubric:vf_rubric_reward")


def test_V03_sys_exit_in_load_environment_is_one_line():
    """V03: ``sys.exit(0)`` in ``load_environment`` made grpolab exit 0 with no output."""
    with pytest.raises(ValueError, match=r"broken_env.py': load_environment called sys.exit\(0\); an environment "
                                         r"must return, not end the process$"):
        load_vf_environment(BROKEN_ENV, {"kind": "exit0"})


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_V07_a_load_environment_that_never_returns_is_a_timeout_and_one_that_exits_is_one_line():
    """V07 and V03: the environment is first built in a supervised child: a hang is a timeout, an
    ``os._exit`` the death of that child, each one line naming the environment."""
    with pytest.raises(ConfigError, match=r"load_environment did not return within 8 s \(env.load_timeout_s\)"):
        probe_environment(BROKEN_ENV, {"kind": "sleep"}, timeout_s=8)
    with pytest.raises(ConfigError, match=r"load_environment ended the process \(exit code 0\) before it returned"):
        probe_environment(BROKEN_ENV, {"kind": "osexit"}, timeout_s=120)
    probe_environment(BROKEN_ENV, {"kind": "raise"}, timeout_s=120)  # the trainer's own load names the exception


@pytest.mark.parametrize("kind, load_args", [("osexit", {}), ("exit0", {}), ("sleep", {"load_timeout_s": 8})])
@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_V03_V07_the_cli_exits_2_with_one_line(tmp_path, kind, load_args):
    """V03/V07 through ``grpolab grpo``: exit 2, one line, and no run directory (it exited 0 silently)."""
    model = chat_model_dir(tmp_path / "m")
    env = json.dumps({"verifiers": BROKEN_ENV, "args": {"kind": kind}, **load_args})
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "grpolab", "grpo", "--model", str(model), "--env", env,
                           "--n-grpo-steps", "1", "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines[-1].startswith("grpolab: error: ") and "broken_env.py" in lines[-1]
    assert "Traceback" not in done.stderr and not run_dir.exists()


@pytest.mark.parametrize("kind, says", [("raises", "reward function raises: the rubric broke"),
                                        ("string", "could not convert string to float: 'high'")])
def test_V04_a_rubric_functions_error_is_a_counted_reward_error(kind, says):
    """V04: verifiers logs a reward function's exception and scores it 0; grpolab counted nothing."""
    rubric = VfRubric(BROKEN_ENV, {"kind": kind})
    truth = VerifiersTask(BROKEN_ENV, {"kind": kind}).examples("train", 1)[0].answer
    with RewardScorer(rubric, timeout_s=60) as scorer:
        scores = scorer.score([truth["row"]["answer"]] * 2, [truth] * 2)
    assert [s["reward"] for s in scores] == [0.0, 0.0] and scorer.errors == 2
    assert "the rubric failed" in scorer.last_error and says in scorer.last_error
    live = {"response": "", "messages": [], "info": {"vf_score": {"reward": 1.0}, "vf_score_error": says}}
    with pytest.raises(ValueError, match="the rubric failed"):  # an environment-driven rollout's live score too
        rubric(live, truth)


def test_V10_an_empty_environment_name_is_one_line_naming_the_field():
    """V10: ``env: {verifiers: ''}`` said "build the environment with grpolab.envs.vf" (internal)."""
    from grpolab.algorithms.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=r"verifiers: expected an environment name, a module or a .py file, got ''"):
        GRPOConfig.build(None, {"env": {"verifiers": ""}})


def test_the_environments_own_dataset_sets_the_runs_size_by_default(tmp_path):
    """Issue 58 item 5: a 65-row environment was refused because task_train_size defaults to 2000;
    its rows are the run's size unless task_train_size is given (then a short dataset is one line)."""
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.training.inputs import load_inputs

    model = str(chat_model_dir(tmp_path / "m"))
    env = {"verifiers": SUM_ENV, "args": {"n": 65, "eval_n": 4}}
    cfg = GRPOConfig(model=model, env=env)
    inputs = load_inputs(cfg)
    assert len(inputs.train) == 65 and cfg.task_train_size == 65  # what the run's config.yaml records
    assert GRPOConfig(**cfg.to_dict()).task_train_size == 65  # a resume reads it back
    with pytest.raises(ValueError, match=r"has 65 train rows \(its dataset\), fewer than the 100 asked"):
        load_inputs(GRPOConfig(model=model, env=env, task_train_size=100))


GROUP_ENV = str(HERE / "group_env.py")


def test_a_group_rubric_scores_each_group_together():
    """Issue 58 item 5: a rubric with a group reward function was refused at load; now each GRPO
    group (the responses to one prompt) is scored together, in the reward workers."""
    from grpolab.rollout import Rollout

    task = VerifiersTask(GROUP_ENV)
    assert task.reward_fn.scores_groups
    a, b = task.examples("train", 2)
    x, y = a.answer["row"]["answer"], b.answer["row"]["answer"]
    texts = [(0, x), (0, f"it is {x}"), (0, "no"), (1, f"it is {y}"), (1, "no")]
    rollouts = [Rollout("p", t, [1], [2], [0.0], "eos", prompt_index=i) for i, t in texts]
    truths = [(a, b)[i].answer for i, _ in texts]
    with RewardScorer(task.reward_fn, timeout_s=60) as scorer:
        scores = scorer.score([t for _, t in texts], truths, rollouts=rollouts)
        assert scorer.mode == "process" and scorer.errors == 0, scorer.last_error
    # "it is X" is not the shortest correct answer of the first group, and is of the second
    assert [s["reward"] for s in scores] == [1.5, 1.0, 0.0, 1.5, 0.0]
    assert [s["vf/shortest_correct"] for s in scores] == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_a_grpo_run_trains_on_a_group_rubric(tmp_path):
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo
    from grpolab.training.metric_logging import read_metrics

    cfg = GRPOConfig(model=str(chat_model_dir(tmp_path / "m")), env={"verifiers": GROUP_ENV}, n_grpo_steps=2,
                     rollout_batch_size=8, group_size=4, train_batch_size=8, gradient_accumulation_steps=2,
                     sampling_max_tokens=4, sampling_min_tokens=1, learning_rate=1e-3, warmup_steps=0,
                     task_train_size=20, eval_examples=4, run_dir=str(tmp_path / "run"), show_progress=False,
                     device="cpu")
    steps = [r for r in read_metrics(train_grpo(cfg).metrics_path) if "train/reward" in r]
    assert len(steps) == 2 and all("train/reward_vf/shortest_correct" in s for s in steps)
    assert all(s["health/reward_errors"] == 0 for s in steps)


def test_V01_an_environment_module_in_the_working_directory_loads_under_the_console_script(tmp_path, monkeypatch):
    """V01: the ``grpolab`` console script has no working directory on ``sys.path``: ``env:
    {verifiers: my_env}`` beside the user was "not found" there (``python -m grpolab`` found it);
    the working directory is now searched last, as the reward workers search it."""
    (tmp_path / "h7_cwd_sum_env.py").write_text((HERE / "sum_env.py").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != tmp_path])
    env = load_vf_environment("h7_cwd_sum_env", {"n": 8})
    assert len(env.build_dataset()) == 8 and sys.path[-1] == str(tmp_path)


def test_V02_eval_figures_never_load_an_environment_the_data_names(tmp_path):
    """V02, the evaluation side: ``evaluate`` looked up the rubric's answer function by loading the
    environment the first ground truth named (``vf_roles``), so an eval data file ran its file."""
    from grpolab.data.datasets import Example
    from grpolab.eval import evaluate
    from grpolab.models import load_model_and_tokenizer
    from grpolab.rollout import SamplingParams
    from tests.eval.test_eval import _answer_reward, _Scripted, _Template

    evil = tmp_path / "evil_env.py"
    evil.write_text(EVIL)
    truth = {"env": str(evil), "args": {}, "row": {"prompt": [{"role": "user", "content": "1+2"}]}}
    _, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    out = evaluate(_Scripted(tok, [["<answer>3</answer>"]]), [Example("1+2", truth)], _Template(), _answer_reward,
                   SamplingParams(max_tokens=8), reward_timeout_s=60)
    assert out.metrics["n"] == 1 and not (tmp_path / "EVIL_RAN").exists()
