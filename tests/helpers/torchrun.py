"""Real ``torchrun`` jobs for the tests: 2 ``gloo`` ranks in a subprocess (a free
``--master_port``, a timeout), a SIGKILL of the whole job, and the JSON rows the ranks print."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
RUN = ["-m", "grpolab", "grpo", "--config", "configs/grpo_tiny.yaml", "--n-grpo-steps", "3", "--rollout-batch-size",
       "8", "--group-size", "4", "--train-batch-size", "8", "--gradient-accumulation-steps", "2",
       "--sampling-max-tokens", "10", "--eval-examples", "4", "--eval-every", "0", "--show-progress", "false",
       "--task-train-size", "40", "--log-generations-samples", "0"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # DeepSpeed JIT-compiles its CPU shared-memory op into TORCH_EXTENSIONS_DIR: one per venv, else
    # .venv and .venv-vllm (other torch builds) recompile it over each other's, minutes each time
    return {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"), **os.environ, "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def torchrun(args: list[str], timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 ARGS``; ``check``: assert it succeeded. Past ``timeout`` the
    whole job is killed (``kill_job``: a SIGKILL of the agent alone would orphan its ranks, still
    holding the output pipes, and the test would wait for them instead of failing) and the test fails."""
    cmd = [*TORCHRUN, "--master_port", str(_port()), *args]
    with subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(proc)
            _, stderr = proc.communicate()
            raise AssertionError(
                f"{' '.join(cmd)} still running after {timeout} s (killed):\n{stderr[-3000:]}"
            ) from None
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert not check or out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}"
    return out


def _process_tree(root: int) -> list[int]:
    """``root`` and every process under it, parents before children (from /proc: parent pids)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree = [root]
    for pid in tree:  # breadth first: the list grows as it is read
        tree += children.get(pid, [])
    return tree


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # dead, not yet reaped
    except (OSError, IndexError):
        return True


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a torchrun job mid-run: the agent, its ranks and whatever they started (vLLM
    engines). Torch elastic starts every rank in a session of its own, so killing the agent's process
    group leaves the ranks training to the end of the run. The tree is stopped first, parents before
    children (a stopped process starts nothing, and reaps nothing, so no pid in it is reused), then
    killed whole."""
    if proc.poll() is not None:  # ended by itself: its agent already stopped the ranks
        return
    stopped: list[int] = []
    while new := [pid for pid in _process_tree(proc.pid) if pid not in stopped]:
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped += new
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30  # the ranks, reparented when the agent died, end within moments
    while not all(_gone(pid) for pid in stopped[1:]) and time.monotonic() < deadline:
        time.sleep(0.05)


def kill_after_first_checkpoint(cmd: list[str], run_dir: Path, wait_s: float) -> None:
    """Start a torchrun job, SIGKILL it whole (``kill_job``) once ``checkpoints/step_1`` is complete,
    and check that it was killed mid-run: the checkpoint is there, ``final/`` is not."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker, deadline = run_dir / "checkpoints" / "step_1" / "trainer_state.pt", time.monotonic() + wait_s
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # a stalled launch is bounded by wait_s: not a speed bound
    kill_job(proc)
    assert marker.exists(), f"the run never wrote its first checkpoint (it failed, or did not start within {wait_s} s)"
    assert not (run_dir / "final").exists(), "the run finished before it was killed"


def json_rows(text: str) -> list[dict]:
    """Every JSON object printed in ``text``. Two ranks print at once, so one rank's line can be glued
    to the other's ('{...}{...}'): each object is read wherever it starts, not line by line."""
    decoder, rows, i = json.JSONDecoder(), [], 0
    while (i := text.find("{", i)) != -1:
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
    return rows
