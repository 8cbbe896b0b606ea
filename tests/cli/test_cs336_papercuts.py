"""CS336 newcomer papercuts (issue 55): ``device: cuda`` on a torch without CUDA is one
``grpolab: error:`` line naming the field (exit 2, no traceback), and ``make clean`` keeps ``runs/``."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command, device", [("grpo", "cuda"), ("sft", "cuda:1")])
def test_cuda_device_without_cuda_is_one_line(tmp_path, command, device):
    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device: nothing to refuse")
    done = subprocess.run([sys.executable, "-m", "grpolab", command, "--device", device, "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"grpolab: error: device: '{device}', but this torch") and "no CUDA device" in last
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed


def test_make_clean_keeps_runs():
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    done = subprocess.run(["make", "-n", "clean"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    removed = [w for line in done.stdout.splitlines() if line.startswith("rm ") for w in line.split()[2:]]
    assert ".venv" in removed and "runs" not in removed and not any(w.startswith("runs/") for w in removed)
