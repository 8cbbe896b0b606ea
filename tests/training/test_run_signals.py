"""Processes end as the user expects (reliability probe, turn 5: A09, A10, A11, V08): Ctrl-C on an
asynchronous run (a sampler process) with its reward in a worker process writes the checkpoint
and exits 130 with one line, neither child dying of the terminal's signal; SIGTERM (``timeout``,
a scheduler, ``docker stop``) writes a checkpoint like Ctrl-C and exits 143. The signal goes to
the whole process group, as a terminal and ``timeout`` send it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.training.test_run import Proc, _has_record, _wait_for, checkpoint_steps, grpolab


def _async_run(run_dir: Path, *extra) -> list[str]:
    return grpolab("grpo", "--n-grpo-steps", "400", "--rollout-batch-size", "8", "--group-size", "4",
                   "--train-batch-size", "8", "--gradient-accumulation-steps", "1", "--sampling-max-tokens", "8",
                   "--sampling-min-tokens", "1", "--eval-examples", "2", "--eval-every", "0", "--task-train-size", "20",
                   "--warmup-steps", "0", "--checkpoint-every", "0", "--show-progress", "false", "--device", "cpu",
                   "--reward", "tests.helpers.reward_fixtures:reward_any_digit", "--run-dir", run_dir, *extra)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl_c", "sigterm"])
def test_A09_A11_a_signal_to_an_async_run_with_workers_writes_the_checkpoint(tmp_path, sig, code):
    """A09/A10: Ctrl-C killed the sampler process with the trainer's group (exit 2, "the sampler
    process died", no checkpoint, its KeyboardInterrupt traceback); V08: it killed the reward
    worker too. A11: SIGTERM killed the run at once, no checkpoint, no message."""
    run_dir = tmp_path / "run"
    run = Proc(_async_run(run_dir, "--max-staleness", "2", "--reward-workers", "1"), tmp_path, "run",
               start_new_session=True)
    _wait_for(lambda: _has_record(run_dir, "train_step"), run, "the first step's metrics")
    os.killpg(run.proc.pid, sig)
    run.wait()
    err = run.stderr
    assert run.returncode == code, f"exit {run.returncode}:\n{err[-4000:]}"
    assert "Traceback" not in err and "died" not in err, err[-4000:]
    hints = [line for line in err.splitlines() if f"--resume {run_dir}" in line]
    assert len(hints) == 1 and ("SIGTERM" if sig == signal.SIGTERM else "Ctrl-C") in hints[0], err
    assert len(checkpoint_steps(run_dir)) == 1
    resumed = Proc(grpolab("grpo", "--resume", run_dir, "--n-grpo-steps", str(checkpoint_steps(run_dir)[0] + 1)),
                   tmp_path, "resume").ok()
    assert (run_dir / "final" / "model.safetensors").exists() and "Traceback" not in resumed.stderr
