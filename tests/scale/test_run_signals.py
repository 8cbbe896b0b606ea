"""Processes end as the user expects (reliability probe, turn 5: A09, A10, A11, V08; in the scale tier: whole
process groups of trainer, sampler and reward workers). Ctrl-C on an
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
    steps = max(3, checkpoint_steps(run_dir)[0] + 1)  # above max_staleness 2
    resumed = Proc(grpolab("grpo", "--resume", run_dir, "--n-grpo-steps", steps), tmp_path, "resume").ok()
    assert (run_dir / "final" / "model.safetensors").exists() and "Traceback" not in resumed.stderr


def test_A14_A15_an_async_checkpoint_resumes_synchronously_and_with_other_sampler_threads(tmp_path):
    """A14: the async guide promises that resuming an async checkpoint with ``max_staleness: 0``
    regenerates its in-flight batches; the resume rules refused any change of ``max_staleness``.
    A15: ``sampler_threads`` (how fast, like ``threads``) was refused on resume."""
    from tests.training.test_run import assert_no_duplicate_steps, records

    run_dir = tmp_path / "run"
    Proc(_async_run(run_dir, "--max-staleness", "2", "--n-grpo-steps", "3", "--checkpoint-every", "1"), tmp_path,
         "first").ok()
    Proc(grpolab("grpo", "--resume", run_dir, "--n-grpo-steps", "4", "--sampler-threads", "2"), tmp_path,
         "threads").ok()
    synchronous = Proc(grpolab("grpo", "--resume", run_dir, "--n-grpo-steps", "5", "--max-staleness", "0"), tmp_path,
                       "sync").ok()
    assert "Traceback" not in synchronous.stderr
    steps = [r for r in records(run_dir) if "train_step" in r]
    assert [r["train_step"] for r in steps] == [0, 1, 2, 3, 4]
    assert "async/staleness_max" in steps[3] and "async/staleness_max" not in steps[4]  # the last one synchronous
    assert_no_duplicate_steps(run_dir)
    refused = Proc(grpolab("grpo", "--resume", run_dir, "--n-grpo-steps", "6", "--max-staleness", "1"), tmp_path,
                   "on").wait()
    assert refused.returncode == 2 and "max_staleness: 0 -> 1" in refused.stderr  # turning it on stays refused
