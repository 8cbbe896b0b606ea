"""A full disk is one clear line, not a traceback (a real 1 MiB tmpfs; needs root to mount)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to fill a disk: {done.stderr.decode().strip() or 'not root'}")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_disk_is_one_line(tiny_disk):
    run_dir = tiny_disk / "run"
    cmd = [sys.executable, "-m", "grpolab", "sft", "--config", "configs/sft_tiny.yaml", "--n-sft-steps", "2",
           "--train-batch-size", "4", "--gradient-accumulation-steps", "1", "--eval-examples", "1",
           "--task-train-size", "8", "--show-progress", "false", "--model", "embedded:small", "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    noise = ("it/s", "Writing", "dtype auto")  # progress bars; dtype auto's one line
    lines = [l for l in done.stderr.splitlines() if l.strip() and not any(n in l for n in noise)]
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines == [f"grpolab: error: no space left on device: {run_dir}"] or (
        len(lines) == 1 and lines[0].startswith("grpolab: error: no space left on device:")), lines


@pytest.mark.parametrize("message", [
    "[enforce fail at inline_container.cc:664] . unexpected pos 4352 vs 4240",
    "[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file data/0: file write failed",
])
def test_torch_save_on_a_full_disk_is_one_line(monkeypatch, tmp_path, message):
    """torch.save's zip writer reports a full disk as a RuntimeError without errno (any layer may wrap it)."""
    from typer.testing import CliRunner

    import grpolab.cli as cli
    import grpolab.cli.train as train_commands
    from grpolab.algorithms.sft import SFTConfig

    def train(cfg, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(train_commands, "_trainer", lambda command: {"sft": (SFTConfig, train)}[command])
    run_dir = tmp_path / "run"
    out = CliRunner().invoke(cli.app,
                             ["sft", "--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--run-dir", str(run_dir)])
    assert out.exit_code == 2, out.output
    assert f"grpolab: error: no space left on device: {run_dir}" in out.output
    assert "Traceback" not in out.output
