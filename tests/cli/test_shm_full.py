"""An asynchronous run whose ``/dev/shm`` is too small for the sampler's staging weights names
``/dev/shm`` and the fix (reliability probe, turn 5, A17: it said ``no space left on device:
<run dir>``, blaming a directory with room to spare). The small ``/dev/shm`` is a 1 MB tmpfs in a
private mount namespace (``unshare -m``: root only), so the machine's own mount is never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a private mount namespace (unshare -m) needs root")
def test_A17_a_full_dev_shm_is_named_with_the_fix(tmp_path):
    run = [sys.executable, "-m", "grpolab", "grpo", "--max-staleness", "1", "--n-grpo-steps", "1",
           "--rollout-batch-size", "4", "--group-size", "2", "--train-batch-size", "4",
           "--gradient-accumulation-steps", "1", "--sampling-max-tokens", "4", "--task-train-size", "8",
           "--eval-examples", "2", "--eval-every", "0", "--show-progress", "false", "--device", "cpu",
           "--run-dir", str(tmp_path / "run")]
    script = "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec \"$@\""
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *run],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    if "mount:" in proc.stderr and proc.returncode != 2:
        pytest.skip(f"no tmpfs mount here: {proc.stderr.strip()[:200]}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("grpolab: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "/dev/shm" in errors[0] and "max_staleness 0" in errors[0] and str(tmp_path) not in errors[0]
