"""The main job end to end (shortened), and the CLI surface."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.experiments.demo import run_demo
from grpolab.training.metric_logging import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def _test_set_metrics(model_dir, seed=0, n=8):
    """The demo's held-out figures recomputed from a saved model directory: the same test questions
    and sampling as the README describes (temperature 1, seeded), evaluated afresh."""
    from grpolab.data import get_task, load_template
    from grpolab.eval import evaluate
    from grpolab.experiments.presets import DEMO_GRPO, TASK, TASK_OPTIONS
    from grpolab.models import load_model_and_tokenizer
    from grpolab.rollout import SamplingParams, make_backend

    model, tok = load_model_and_tokenizer(str(model_dir))
    task = get_task(TASK, seed=seed, **TASK_OPTIONS)
    sampling = SamplingParams(temperature=1.0, max_tokens=DEMO_GRPO["sampling_max_tokens"], min_tokens=1,
                              stop=["</answer>"], seed=seed + 12345)
    return evaluate(make_backend("hf", model, tok), task.examples("test", n), load_template(task.default_template),
                    task.reward_fn, sampling).metrics


def test_demo_writes_summary_plot_metrics_and_final_model(tmp_path):
    summary = run_demo(tmp_path / "demo", seed=0, sft_steps=5, grpo_steps=2, test_examples=8, show_progress=False)
    written = json.loads((tmp_path / "demo" / "summary.json").read_text())
    # the table's figures are those of the saved models: the SFT model (sft/final) before GRPO and
    # the final model after, recomputed here from the directories
    before = _test_set_metrics(tmp_path / "demo" / "sft" / "final")
    after = _test_set_metrics(tmp_path / "demo" / "final")
    for phase, expected in (("before", before), ("after", after)):
        for key in ("accuracy", "format_rate", "mean_length"):
            assert written[phase][key] == pytest.approx(expected[key]), (phase, key)
    assert written["accuracy_gain_points"] == pytest.approx(round(100 * (after["accuracy"] - before["accuracy"]), 1))
    untrained = _test_set_metrics("embedded:tiny")  # the figures tell models apart: the untrained one differs
    assert untrained["mean_length"] != before["mean_length"] or untrained["format_rate"] != before["format_rate"]
    assert written["test_examples"] == 8 and written["seed"] == 0
    grpo_steps = [
        r["grpo_step"] for r in read_metrics(tmp_path / "demo" / "grpo" / "metrics.jsonl") if "train/reward" in r
    ]
    assert grpo_steps == [0, 1]
    assert summary["paths"]["final"] == str(tmp_path / "demo" / "final")
    assert {"sft_s", "eval_before_s", "grpo_s", "eval_after_s", "total_s"} <= set(written["wall_seconds"])
    assert (tmp_path / "demo" / "grpo_demo.png").stat().st_size > 1000
    assert (tmp_path / "demo" / "grpo" / "metrics.jsonl").exists()
    final = tmp_path / "demo" / "final"
    AutoModelForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)


def test_demo_trains_both_phases_in_the_dtype_asked_for(tmp_path):
    import yaml

    summary = run_demo(tmp_path / "demo", seed=0, sft_steps=2, grpo_steps=1, test_examples=4, show_progress=False,
                       dtype="bfloat16")
    assert summary["dtype"] == "bfloat16" and summary["torch_threads"] >= 1
    for phase in ("sft", "grpo"):
        assert yaml.safe_load((tmp_path / "demo" / phase / "config.yaml").read_text())["dtype"] == "bfloat16"


def test_demo_without_a_learning_signal_stops_grpo_and_says_what_to_try(tmp_path, capsys):
    """A one-step warm start solves nothing: GRPO stops after NO_SIGNAL_STEPS all-zero steps (not
    its whole budget) with one line naming the cause and what to try; the weights are the SFT
    model's (zero advantages move nothing), and the summary says so."""
    from grpolab.experiments.demo import NO_SIGNAL_STEPS

    summary = run_demo(tmp_path / "demo", seed=0, sft_steps=1, grpo_steps=3 * NO_SIGNAL_STEPS, test_examples=4,
                       show_progress=False)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "no learning signal" in line]
    assert len(lines) == 1 and "--sft-steps" in lines[0] and "--seed" in lines[0]
    assert summary["grpo_stopped"] == lines[0]
    steps = [r["grpo_step"] for r in read_metrics(tmp_path / "demo" / "grpo" / "metrics.jsonl") if "train/reward" in r]
    assert steps == list(range(NO_SIGNAL_STEPS))
    assert summary["after"] == summary["before"] and summary["accuracy_gain_points"] == 0.0
    sft = AutoModelForCausalLM.from_pretrained(tmp_path / "demo" / "sft" / "final").state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "demo" / "final").state_dict()
    assert all(torch.equal(sft[k], final[k]) for k in sft)


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "grpolab.cli", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0
    for cmd in ("demo", "grpo", "sft"):
        assert cmd in out.stdout


def test_eval_command_writes_metrics_and_generations(tmp_path):
    from grpolab.models import load_model_and_tokenizer, save_model_and_tokenizer

    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    save_model_and_tokenizer(model, tok, tmp_path / "m")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Q: 1+2\nA: <think>1+2=3</think> <answer>3</answer>\n" * 20)
    out = subprocess.run([sys.executable, "-m", "grpolab.cli", "eval", "--model", str(tmp_path / "m"), "--data",
                          "task:arithmetic", "--n", "4", "--k", "3", "--max-tokens", "12", "--corpus", str(corpus),
                          "--out", str(tmp_path / "ev")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    metrics = json.loads((tmp_path / "ev" / "eval.json").read_text())
    for key in ("accuracy", "format_rate", "pass@3", "pass@1", "maj@3", "consistency", "distinct_1", "distinct_2",
                "distinct_answers_per_question", "perplexity", "token_entropy", "mean_length"):
        assert key in metrics, key
    assert metrics["questions"] == 4 and len((tmp_path / "ev" / "generations.jsonl").read_text().splitlines()) == 12
    assert 1.0 < metrics["perplexity"] < 200
    assert "pass@3" in out.stdout


def test_compare_writes_report(tmp_path):
    from grpolab.experiments.compare import run_compare

    report = run_compare(tmp_path / "cmp", seed=0, steps=1, k=2, test_examples=4, warm_steps=3, show_progress=False)
    assert set(report["methods"]) == {"SFT warm start", "MLE (SFT)", "PPO", "GRPO"}
    for name in ("report.md", "report.json", "report.png"):
        assert (tmp_path / "cmp" / name).exists()
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "| GRPO |" in md and "consistency" in md
    assert json.loads((tmp_path / "cmp" / "report.json").read_text())["sample_budget"] == 128
