"""The main job end to end (shortened), and the CLI surface."""

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.demo import run_demo

ROOT = Path(__file__).resolve().parents[1]


def test_demo_writes_summary_plot_metrics_and_final_model(tmp_path):
    summary = run_demo(tmp_path / "demo", seed=0, sft_steps=5, grpo_steps=2, test_examples=8, show_progress=False)
    written = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    for phase in ("before", "after"):
        assert {"accuracy", "format_rate", "mean_length"} <= set(written[phase])
    assert {"sft_s", "eval_before_s", "grpo_s", "eval_after_s", "total_s"} <= set(written["wall_seconds"])
    assert (tmp_path / "demo" / "grpo_demo.png").stat().st_size > 1000
    assert (tmp_path / "demo" / "grpo" / "metrics.jsonl").exists()
    final = tmp_path / "demo" / "final"
    AutoModelForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "grpolab.cli", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0
    for cmd in ("demo", "grpo", "sft"):
        assert cmd in out.stdout
