"""The ``grpolab`` console script imports a ``module:function`` reward from the working directory,
as ``python -m grpolab`` does and the safety guide promises (searched last, after the installed
packages) — reliability probe, turn 5, case O01: it answered ``cannot import module``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).with_name("grpolab")


@pytest.mark.skipif(not SCRIPT.exists(), reason=f"no grpolab console script beside {sys.executable}")
def test_O01_the_console_script_finds_a_reward_module_in_the_working_directory(tmp_path):
    (tmp_path / "o01_reward.py").write_text("def rand(response, ground_truth):\n    return {'reward': 0.5}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(SCRIPT), "grpo", "--reward", "o01_reward:rand", "--n-grpo-steps", "1", "--rollout-batch-size", "4",
         "--group-size", "2", "--train-batch-size", "4", "--gradient-accumulation-steps", "1",
         "--sampling-max-tokens", "4", "--task-train-size", "8", "--eval-examples", "2", "--eval-every", "0",
         "--checkpoint-every", "0", "--show-progress", "false", "--device", "cpu", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
