"""``grpolab demo --tools`` end to end at tiny settings: it runs, prints the table, and the figures
in summary.json are those of the saved models (recomputed here from the directories)."""

import json

import pytest

from grpolab.data import get_task
from grpolab.envs import build_env
from grpolab.experiments.demo_tools import MODES, TOOLS_ENV, evaluate_modes, run_tools_demo
from grpolab.models import load_model_and_tokenizer
from grpolab.rewards import RewardScorer
from grpolab.rollout import SamplingParams


def _recompute(model_dir, summary, run_dir):
    """The three held-out figures of a saved model, from fresh objects: the task and the corpus
    written by the run, the same questions, sampling and seeds."""
    model, tok = load_model_and_tokenizer(str(model_dir))
    task = get_task("retrieval", seed=summary["seed"], **summary["task_options"])
    env = build_env(["search"], corpus=summary["paths"]["corpus"], cache_dir=str(run_dir / "bm25"), **TOOLS_ENV)
    test = task.examples("test", summary["test_examples"])
    sampling = SamplingParams(temperature=1.0, max_tokens=summary["grpo"]["sampling_max_tokens"], min_tokens=1,
                              stop=["</answer>"])
    with RewardScorer(task.reward_fn, timeout_s=10.0) as scorer:
        return evaluate_modes(model, tok, env, test, scorer, sampling, summary["seed"] + 12345)


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_tools_demo_runs_end_to_end_and_reports_the_saved_models(tmp_path):
    lines = []
    summary = run_tools_demo(tmp_path / "demo", seed=0, sft_steps=4, grpo_steps=2, test_examples=6,
                             train_examples=64, log=lines.append, show_progress=False)
    written = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    for phase, model_dir in (("before", written["paths"]["sft_final"]), ("after", written["paths"]["final"])):
        again = _recompute(model_dir, written, tmp_path / "demo")
        for _, key in MODES:
            assert written[phase][key]["accuracy"] == pytest.approx(again[key]["accuracy"]), (phase, key)
        assert written[phase]["tools"]["tools/call_rate"] == pytest.approx(again["tools"]["tools/call_rate"])
        assert written[phase]["tools"]["tools/model_tokens"] == pytest.approx(again["tools"]["tools/model_tokens"])
    assert written["tool_accuracy_gain_points"] == pytest.approx(
        round(100 * (written["after"]["tools"]["accuracy"] - written["before"]["tools"]["accuracy"]), 1))
    assert written["test_examples"] == 6 and written["sft"]["n_sft_steps"] == 4 and written["grpo"]["n_grpo_steps"] == 2
    assert len(written["grpo_history"]) == 2
    assert {"sft_s", "eval_before_s", "grpo_s", "eval_after_s", "total_s"} <= set(written["wall_seconds"])
    table = "\n".join(lines)
    for label, _ in MODES:
        assert label in table
    assert "answers that called the tool" in table and "tool-use accuracy gain" in table


def test_the_tools_config_file_is_the_demos_grpo_phase():
    from pathlib import Path

    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.experiments.demo_tools import TOOLS_GRPO, TOOLS_TASK_OPTIONS

    cfg = GRPOConfig.build(Path(__file__).parents[2] / "configs" / "grpo_tools_tiny.yaml")
    assert {k: getattr(cfg, k) for k in TOOLS_GRPO} == TOOLS_GRPO
    assert cfg.task == "retrieval" and cfg.task_options == TOOLS_TASK_OPTIONS
    assert {k: cfg.env[k] for k in TOOLS_ENV} == TOOLS_ENV and cfg.env["tools"] == ["search"]
