"""``Run`` end to end, through the real command line: SIGKILL + ``--resume`` gives bit-identical
weights for every trainer, leftovers of interrupted atomic writes are removed, a run directory that
holds a run is refused (and left untouched), resume refuses config changes but may extend a run,
a truncated newest checkpoint is skipped, a hanging or crashing reward cannot stall or end a run,
and Ctrl-C stops at a safe point with a ``--resume`` hint.

Every run is a real ``python -m grpolab`` subprocess on the embedded tiny model, single-threaded
(``OMP_NUM_THREADS=1``) so the uninterrupted and the resumed run do the same arithmetic. Runs
that do not depend on each other are started together: most of a tiny run is Python start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TIMEOUT = 240  # a hang guard only: every run here takes seconds

COMMON = ["--show-progress", "false", "--device", "cpu", "--deterministic", "true", "--checkpoint-every", "1",
          "--seed", "0"]
N_STEPS = 5
# Tiny runs of each trainer (N_STEPS outer steps, a checkpoint after each). Every step changes the weights
# (SFT and DPO through their losses; the RL methods through a reward that the random tiny model
# sometimes earns), so a resume that restored nothing cannot end with the same weights by accident.
TRAINERS = {
    "sft": ["sft", "--n-sft-steps", N_STEPS, "--train-batch-size", "4", "--gradient-accumulation-steps", "1",
            "--task-train-size", "20", "--eval-examples", "2", "--eval-every", "1", "--sampling-max-tokens", "4",
            "--warmup-steps", "0", "--learning-rate", "1e-3", "--lr-schedule", "cosine"],  # SFT's default schedule
    "ei": ["ei", "--n-ei-steps", N_STEPS, "--ei-batch-size", "4", "--group-size", "2", "--train-batch-size", "4",
           "--gradient-accumulation-steps", "1", "--task-train-size", "20", "--eval-examples", "2",
           "--sampling-max-tokens", "8", "--sampling-min-tokens", "1", "--learning-rate", "1e-3", "--reward",
           "tests.helpers.reward_fixtures:reward_any_digit"],
    "grpo": ["grpo", "--n-grpo-steps", N_STEPS, "--rollout-batch-size", "8", "--group-size", "4", "--train-batch-size",
             "8", "--gradient-accumulation-steps", "1", "--sampling-max-tokens", "8", "--sampling-min-tokens", "1",
             "--eval-examples", "2", "--eval-every", "1", "--task-train-size", "20", "--warmup-steps", "0",
             "--learning-rate", "1e-3", "--reward", "tests.helpers.reward_fixtures:reward_any_digit", "--keep-last",
             "10"],
    # asynchronous: a sampler process two policy versions ahead; its in-flight batches are in the checkpoint
    "grpo_async": ["grpo", "--n-grpo-steps", N_STEPS, "--rollout-batch-size", "8", "--group-size", "4",
                   "--train-batch-size", "8", "--gradient-accumulation-steps", "1", "--sampling-max-tokens", "8",
                   "--sampling-min-tokens", "1", "--eval-examples", "2", "--eval-every", "1", "--task-train-size",
                   "20", "--warmup-steps", "0", "--learning-rate", "1e-3", "--reward",
                   "tests.helpers.reward_fixtures:reward_any_digit", "--max-staleness", "2"],
    "ppo": ["ppo", "--n-ppo-steps", N_STEPS, "--rollout-batch-size", "8", "--group-size", "2", "--train-batch-size",
            "4", "--ppo-epochs", "1", "--task-train-size", "20", "--eval-examples", "2", "--eval-every", "1",
            "--sampling-max-tokens", "8", "--sampling-min-tokens", "1", "--learning-rate", "1e-3", "--reward",
            "tests.helpers.reward_fixtures:reward_any_digit"],
    # on-policy distillation: a random embedded:small teacher, so every step moves the student
    "distill": ["distill", "--n-distill-steps", N_STEPS, "--teacher", "embedded:small", "--rollout-batch-size", "8",
                "--group-size", "4", "--train-batch-size", "8", "--gradient-accumulation-steps", "1",
                "--sampling-max-tokens", "8", "--sampling-min-tokens", "1", "--eval-examples", "2", "--eval-every", "1",
                "--task-train-size", "20", "--learning-rate", "1e-3"],
    "dpo": ["dpo", "--n-dpo-steps", N_STEPS, "--train-batch-size", "2", "--task-train-size", "20", "--eval-pairs", "2",
            "--eval-every", "1", "--learning-rate", "1e-3"],
}
GRPO_STEPS = N_STEPS


# ---------------------------------------------------------------- helpers


def grpolab(*args) -> list[str]:
    return [sys.executable, "-m", "grpolab", *map(str, args)]


def train_cmd(trainer: str, run_dir: Path, *extra) -> list[str]:
    return grpolab(*TRAINERS[trainer], *COMMON, "--run-dir", run_dir, *extra)


class Proc:
    """A grpolab subprocess whose stdout/stderr go to files (so that any number can run at once)."""

    def __init__(self, argv: list[str], log_dir: Path, name: str, **popen):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")  # noqa: SIM115 - closed in wait()
        self.argv, self.started = argv, time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL, cwd=ROOT,
                                     env=ENV, **popen)
        self.returncode: int | None = None
        self.wall_s: float | None = None

    def wait(self, timeout: float = TIMEOUT) -> Proc:
        if self.returncode is None:
            try:
                self.returncode = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(
                    f"{' '.join(self.argv[2:])} did not finish within {timeout}s; stderr:\n{self.stderr}"
                )
            finally:
                self.wall_s = time.monotonic() - self.started
                self._out.close()
                self._err.close()
        return self

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def ok(self) -> Proc:
        self.wait()
        assert self.returncode == 0, f"{' '.join(self.argv[2:])} exited {self.returncode}:\n{self.stderr[-4000:]}"
        return self


def run_together(log_dir: Path, **argvs: list[str]) -> dict[str, Proc]:
    """Start every command at once, wait for all of them."""
    procs = {name: Proc(argv, log_dir, name) for name, argv in argvs.items()}
    for p in procs.values():
        p.wait()
    return procs


def assert_one_line_error(proc: Proc, *needles: str) -> str:
    """Exit code 2 and stderr exactly one line ``grpolab: error: ...`` (no traceback)."""
    proc.wait()
    err = proc.stderr
    lines = err.strip("\n").splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}, stderr:\n{err[-4000:]}"
    assert len(lines) == 1 and lines[0].startswith("grpolab: error: "), f"not one error line:\n{err[-4000:]}"
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(path: Path) -> dict[str, str]:
    """Every file and directory under ``path``: relative path -> content hash ('<dir>' for directories)."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def records(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def assert_no_duplicate_steps(run_dir: Path, like: Path | None = None) -> None:
    """No ``train_step`` and no ``eval_step`` value logged twice; with ``like``, the same values as
    that (uninterrupted) run logged."""
    recs = records(run_dir)
    for key in ("train_step", "eval_step"):
        values = [r[key] for r in recs if key in r]
        assert len(values) == len(set(values)), f"{key} duplicated in {run_dir}/metrics.jsonl: {values}"
        if like is not None:
            expected = [r[key] for r in records(like) if key in r]
            assert sorted(values) == sorted(expected), (key, values, expected)


class WeightsDiffer(AssertionError):
    """Two weight files that should be bit-identical are not (an expected failure names this)."""


def assert_same_tensors(a_path: Path, b_path: Path) -> None:
    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    if different:
        raise WeightsDiffer(
            f"{len(different)} of {len(a)} tensors differ between {a_path} and {b_path}: {different[:5]}"
        )


def assert_some_tensor_differs(a_path: Path, b_path: Path) -> None:
    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert any(not torch.equal(a[k], b[k]) for k in a), f"{a_path} and {b_path} are identical: nothing was trained"


def checkpoint_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return (sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / "trainer_state.pt").exists())
            if root.is_dir()
            else [])


def start_and_sigkill(argv: list[str], run_dir: Path, log_dir: Path, name: str) -> Proc:
    """Start a run, wait until ``checkpoints/step_1`` is complete and one more metrics record has
    been written after it (so the kill lands in step 2, past the checkpoint's metrics offset), then
    SIGKILL it."""
    proc = Proc(argv, log_dir, name)
    marker = run_dir / "checkpoints" / "step_1" / "trainer_state.pt"
    _wait_for(marker.exists, proc, f"{name}'s first checkpoint")
    metrics = run_dir / "metrics.jsonl"
    size = metrics.stat().st_size
    grow_until = time.monotonic() + 10
    while metrics.stat().st_size == size and proc.proc.poll() is None and time.monotonic() < grow_until:
        time.sleep(0.005)
    proc.proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"{name} was not killed (exit {proc.returncode}): it ran to the end"
    assert not (run_dir / "final").exists(), f"{name} finished before it could be killed"
    return proc


@pytest.fixture(scope="module")
def grpo_full(tmp_path_factory):
    """An uninterrupted GRPO run (every checkpoint kept), started in the background as soon as a
    test asks for it; ``grpo_full()`` waits for it and returns its run directory."""
    base = tmp_path_factory.mktemp("grpo_full")
    run_dir = base / "run"
    proc = Proc(train_cmd("grpo", run_dir), base, "full")

    def done() -> Path:
        proc.ok()
        return run_dir

    yield done
    if proc.proc.poll() is None:
        proc.proc.kill()
        proc.wait()


# ---------------------------------------------------------------- 1. SIGKILL + resume, every trainer


@pytest.mark.parametrize("trainer", [
    "grpo",
    "grpo_async",  # the resumed run trains on the saved in-flight batches, then generates what the full run did
    "sft",  # cosine schedule with warm-up: the resumed step must use the saved learning rate
    "ei",
    "ppo",
    "dpo",
    "distill",
])
@pytest.mark.slow  # make test-slow (test-all), not make test: minutes of real processes
def test_sigkill_then_resume_ends_with_the_uninterrupted_weights(trainer, tmp_path, request):
    if trainer == "grpo":  # the shared uninterrupted run, started in the background
        wait_full = request.getfixturevalue("grpo_full")
    else:  # the uninterrupted run, side by side with the one to be killed
        full_proc = Proc(train_cmd(trainer, tmp_path / "full"), tmp_path, "full")

        def wait_full() -> Path:
            full_proc.ok()
            return tmp_path / "full"
    killed = tmp_path / "killed"
    start_and_sigkill(train_cmd(trainer, killed), killed, tmp_path, "killed")
    resume_from = checkpoint_steps(killed)[-1]
    assert 1 <= resume_from < N_STEPS, checkpoint_steps(killed)
    at_kill = load_file(str(killed / "checkpoints" / f"step_{resume_from}" / "model.safetensors"))

    resumed = Proc(grpolab(TRAINERS[trainer][0], "--resume", killed), tmp_path, "resume").ok()
    full_dir = wait_full()

    assert "Traceback" not in resumed.stderr
    assert_no_duplicate_steps(killed, like=full_dir)
    final = load_file(str(killed / "final" / "model.safetensors"))
    assert any(not torch.equal(at_kill[k], final[k]) for k in final), "the resumed steps trained nothing"
    assert_same_tensors(full_dir / "final" / "model.safetensors", killed / "final" / "model.safetensors")
    if trainer == "ppo":  # the value head is part of the run too
        assert_same_tensors(full_dir / "final" / "value_head.safetensors", killed / "final" / "value_head.safetensors")


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_leftovers_of_interrupted_writes_are_removed_and_overwrite_replaces_the_run(grpo_full, tmp_path):
    full = grpo_full()

    def plant(run_dir: Path) -> list[Path]:
        leftovers = [run_dir / ".tmp_final_xyz", run_dir / ".old_final", run_dir / "checkpoints" / ".tmp_step_9_abc"]
        for d in leftovers:
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"half a file")
        (run_dir / "checkpoints" / ".tmp_step_9_abc" / "trainer_state.pt").write_bytes(b"junk")
        return leftovers

    resumed_dir, fresh_dir = copy_run(full, tmp_path / "resumed"), copy_run(full, tmp_path / "fresh")
    planted = plant(resumed_dir) + plant(fresh_dir)
    old_checkpoints = checkpoint_steps(fresh_dir)
    assert old_checkpoints == list(range(1, GRPO_STEPS + 1))
    procs = run_together(tmp_path,
                         resume=grpolab("grpo", "--resume", resumed_dir),
                         overwrite=train_cmd("grpo", fresh_dir, "--n-grpo-steps", "1", "--overwrite"))
    procs["resume"].ok()
    procs["overwrite"].ok()
    for d in planted:
        assert not d.exists(), f"leftover {d} survived"
    # resuming a finished run re-writes final/ from the last checkpoint: the same weights, no duplicates
    assert_same_tensors(full / "final" / "model.safetensors", resumed_dir / "final" / "model.safetensors")
    assert_no_duplicate_steps(resumed_dir, like=full)
    # --overwrite replaced the whole run: one step, its own checkpoint, metrics and config only
    assert checkpoint_steps(fresh_dir) == [1]
    assert [r["train_step"] for r in records(fresh_dir) if "train_step" in r] == [0]
    assert "n_grpo_steps: 1\n" in (fresh_dir / "config.yaml").read_text()
    assert not (fresh_dir / "samples" / f"eval_step_{GRPO_STEPS}.jsonl").exists()
    assert_some_tensor_differs(full / "final" / "model.safetensors", fresh_dir / "final" / "model.safetensors")


# ---------------------------------------------------------------- 2. a directory that holds a run


@pytest.mark.slow  # make test-slow (test-all), not make test: minutes of real processes
def test_a_fresh_run_into_a_directory_that_holds_a_run_is_refused_and_touches_nothing(grpo_full, tmp_path):
    full = grpo_full()
    dirs = {name: tmp_path / name for name in ("metrics", "checkpoints", "final")}
    dirs["metrics"].mkdir()
    for name in ("metrics.jsonl", "config.yaml"):
        shutil.copy2(full / name, dirs["metrics"] / name)
    shutil.copytree(full / "checkpoints" / "step_1", dirs["checkpoints"] / "checkpoints" / "step_1")
    shutil.copytree(full / "final", dirs["final"] / "final")
    before = {name: snapshot(d) for name, d in dirs.items()}
    assert (dirs["metrics"] / "metrics.jsonl").stat().st_size > 0

    procs = run_together(tmp_path, **{name: train_cmd("grpo", d) for name, d in dirs.items()})
    for name, d in dirs.items():
        assert_one_line_error(procs[name], "--resume", "--overwrite", str(d))
        assert snapshot(d) == before[name], f"{name}: the refused run changed the directory"


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_invalid_input_for_an_existing_run_dir_exits_2_and_leaves_it_untouched(grpo_full, tmp_path):
    """With --overwrite, the dangerous case: every input is checked before the old run is removed."""
    full = grpo_full()
    not_a_model = tmp_path / "not_a_model"  # a directory, but no config.json or weights in it
    not_a_model.mkdir()
    cases = {
        "missing_train_data": (["--task", "null", "--train-data", tmp_path / "missing.jsonl"], "missing.jsonl"),
        "unknown_reward": (["--reward", "nosuch.module:fn"], "nosuch.module"),
        "bad_model": (["--model", not_a_model], str(not_a_model)),
    }
    dirs = {name: copy_run(full, tmp_path / name) for name in cases}
    before = {name: snapshot(d) for name, d in dirs.items()}
    procs = run_together(tmp_path, **{name: train_cmd("grpo", dirs[name], *args, "--overwrite")
                                      for name, (args, _) in cases.items()})
    for name, (_, needle) in cases.items():
        assert_one_line_error(procs[name], needle)
        assert snapshot(dirs[name]) == before[name], f"{name}: the failed run changed the directory"


# ---------------------------------------------------------------- 3. config changes on resume


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_resume_refuses_a_changed_learning_rate_and_may_extend_the_run(grpo_full, tmp_path):
    full = grpo_full()
    refused_dir, extended_dir = copy_run(full, tmp_path / "refused"), copy_run(full, tmp_path / "extended")
    before = snapshot(refused_dir)
    old_lr = float(re.search(r"^learning_rate: (.+)$", (full / "config.yaml").read_text(), re.MULTILINE).group(1))
    procs = run_together(tmp_path,
                         refused=grpolab("grpo", "--resume", refused_dir, "--learning-rate", "0.5"),
                         extended=grpolab("grpo", "--resume", extended_dir, "--n-grpo-steps", GRPO_STEPS + 2))
    assert_one_line_error(procs["refused"], f"learning_rate: {old_lr!r} -> 0.5", str(refused_dir))
    assert snapshot(refused_dir) == before

    procs["extended"].ok()
    assert f"n_grpo_steps: {GRPO_STEPS + 2}\n" in (extended_dir / "config.yaml").read_text()
    recs = records(extended_dir)
    assert sorted(r["train_step"] for r in recs if "train_step" in r) == list(range(GRPO_STEPS + 2))
    assert max(r["grpo_step"] for r in recs if "train_step" in r) == GRPO_STEPS + 1
    assert_no_duplicate_steps(extended_dir)
    assert checkpoint_steps(extended_dir)[-1] == GRPO_STEPS + 2
    assert_some_tensor_differs(full / "final" / "model.safetensors", extended_dir / "final" / "model.safetensors")


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_resume_refuses_fewer_steps_than_the_run_has_done(grpo_full, tmp_path):
    run_dir = copy_run(grpo_full(), tmp_path / "run")
    before = snapshot(run_dir)
    proc = Proc(grpolab("grpo", "--resume", run_dir, "--n-grpo-steps", 2), tmp_path, "shrink").wait()
    assert_one_line_error(proc, "n_grpo_steps")
    assert snapshot(run_dir) == before


# ---------------------------------------------------------------- 4. a truncated newest checkpoint


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_truncated_newest_checkpoints_are_skipped_and_the_run_completes(grpo_full, tmp_path):
    """As if killed after step 3's checkpoint, and the disk then lost half of step 3's weights and
    half of step 2's trainer state: resume skips both (saying which and why), falls back to step 1,
    and still ends with the uninterrupted run's weights."""
    full = grpo_full()
    run_dir = copy_run(full, tmp_path / "run")
    shutil.rmtree(run_dir / "final")
    for step in range(4, GRPO_STEPS + 1):
        shutil.rmtree(run_dir / "checkpoints" / f"step_{step}")
    damaged = {3: run_dir / "checkpoints" / "step_3" / "model.safetensors",
               2: run_dir / "checkpoints" / "step_2" / "trainer_state.pt"}
    for f in damaged.values():
        os.truncate(f, f.stat().st_size // 2)

    proc = Proc(grpolab("grpo", "--resume", run_dir), tmp_path, "resume").ok()
    for step in damaged:
        said = [line for line in proc.stderr.splitlines() if f"step_{step}" in line]
        assert said and "cannot be read (" in said[0] and "trying an older one" in said[0], proc.stderr
    assert not [line for line in proc.stderr.splitlines() if "step_1 cannot be read" in line]
    assert_same_tensors(full / "final" / "model.safetensors", run_dir / "final" / "model.safetensors")
    assert_no_duplicate_steps(run_dir, like=full)


# ---------------------------------------------------------------- 5. rewards that hang or crash


@pytest.mark.slow  # make test-slow (test-all), not make test: minutes of real processes
def test_a_hanging_or_crashing_reward_neither_stalls_nor_ends_the_run(tmp_path):
    def cmd(reward: str, run_dir: Path) -> list[str]:
        return grpolab(
            "grpo",
            "--n-grpo-steps",
            "2",
            "--rollout-batch-size",
            "2",
            "--group-size",
            "2",
            "--train-batch-size",
            "2",
            "--gradient-accumulation-steps",
            "1",
            "--sampling-max-tokens",
            "4",
            "--sampling-min-tokens",
            "1",
            "--eval-examples",
            "1",
            "--task-train-size",
            "8",
            "--warmup-steps",
            "0",
            "--reward",
            f"tests.helpers.reward_fixtures:{reward}",
            "--reward-timeout-s",
            "1",
            "--show-progress",
            "false",
            "--device",
            "cpu",
            "--run-dir",
            run_dir,
        )

    procs = run_together(tmp_path, hang=cmd("hang", tmp_path / "hang"), exit3=cmd("exit3", tmp_path / "exit3"))
    # the `hang` reward never returns: the run finishing at all (within run_together's process
    # timeout) is the liveness proof; a wall-clock bound would fail on a busy machine
    for name, proc in procs.items():
        proc.ok()
        train = [r for r in records(tmp_path / name) if "health/reward_errors" in r]
        assert len(train) == 2 and all(r["health/reward_errors"] > 0 for r in train), train
        assert (tmp_path / name / "final" / "model.safetensors").exists()
    assert "timed out" in procs["hang"].stderr + procs["hang"].stdout
    assert "exit code 3" in procs["exit3"].stderr + procs["exit3"].stdout


# ---------------------------------------------------------------- 6. Ctrl-C


def _cpu_and_state(pid: int) -> tuple[float, str]:
    """(user + system CPU seconds, scheduler state) of a live process (Linux ``/proc``): what a run
    has done, which a busy machine does not inflate the way it inflates wall time; a starved
    process is runnable ("R"), a stalled one sleeps ("S"/"D") without using CPU."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except FileNotFoundError:  # it just ended: the caller's poll() says so next
        return 0.0, "X"
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), fields[0]


STALLED_POLLS = 30_000  # consecutive polls asleep without a tick of CPU: a hang, never load


def _wait_for(predicate, proc: Proc, what: str, timeout: float = TIMEOUT) -> None:
    """Until ``predicate()``; fails if the run ends first, spends ``timeout`` seconds of its own
    CPU without getting there, or sleeps without using any CPU for STALLED_POLLS polls in a row
    (a hang: a run slowed by load stays runnable or keeps using CPU). No wall-clock bound."""
    cpu0, _ = _cpu_and_state(proc.proc.pid)
    last, idle = cpu0, 0
    while not predicate():
        assert proc.proc.poll() is None, f"the run ended before {what}:\n{proc.stderr[-4000:]}"
        cpu, state = _cpu_and_state(proc.proc.pid)
        assert cpu - cpu0 < timeout, f"no {what} within {timeout} CPU seconds of the run"
        idle = idle + 1 if cpu == last and state in "SD" else 0
        last = cpu
        assert idle < STALLED_POLLS, f"no {what}: the run sleeps without using CPU (stalled)"
        time.sleep(0.01)


def _has_record(run_dir: Path, key: str) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and f'"{key}"' in path.read_text()


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_ctrl_c_checkpoints_the_step_and_hints_resume_a_second_ctrl_c_stops_at_once(tmp_path):
    def cmd(run_dir: Path, *extra) -> list[str]:
        return grpolab("grpo", "--rollout-batch-size", "8", "--group-size", "4", "--train-batch-size", "8",
                       "--gradient-accumulation-steps", "1", "--sampling-max-tokens", "8", "--sampling-min-tokens", "1",
                       "--eval-examples", "2", "--task-train-size", "20", "--warmup-steps", "0",
                       "--checkpoint-every", "0", "--show-progress", "false", "--device", "cpu", "--run-dir", run_dir,
                       *extra)

    once, twice = tmp_path / "once", tmp_path / "twice"
    # Ctrl-C in a terminal signals the whole foreground process group: so do we
    a = Proc(cmd(once, "--n-grpo-steps", "12"), tmp_path, "once", start_new_session=True)
    # steps long enough that a run which ignored the second Ctrl-C would visibly finish the step
    b = Proc(cmd(twice, "--n-grpo-steps", "1000", "--rollout-batch-size", "512", "--group-size", "8",
                 "--train-batch-size", "512", "--sampling-max-tokens", "64", "--sampling-min-tokens", "64"),
             tmp_path, "twice", start_new_session=True)

    _wait_for(lambda: _has_record(once, "train_step"), a, "first step's metrics")
    os.killpg(a.proc.pid, signal.SIGINT)
    _wait_for(lambda: _has_record(twice, "eval_step"), b, "first validation")  # inside the loop, handler installed
    os.killpg(b.proc.pid, signal.SIGINT)
    _wait_for(lambda: "Ctrl-C" in b.stderr, b, "the first Ctrl-C's message", timeout=30)
    second = time.monotonic()
    os.killpg(b.proc.pid, signal.SIGINT)
    b.wait(timeout=60)
    stopped_s = time.monotonic() - second
    a.wait()

    # the first Ctrl-C: exit 130, a one-line --resume hint, a loadable checkpoint of that step
    assert a.returncode == 130, f"exit {a.returncode}:\n{a.stderr[-4000:]}"
    hints = [line for line in a.stderr.splitlines() if f"--resume {once}" in line]
    assert len(hints) == 1, a.stderr
    assert "Traceback" not in a.stderr
    step = int(re.search(r"interrupted after step (\d+)", hints[0]).group(1))
    assert 1 <= step < 12
    ckpt = once / "checkpoints" / f"step_{step}"
    assert checkpoint_steps(once) == [step]
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["counters"]["step"] == step
    load_file(str(ckpt / "model.safetensors"))
    assert not (once / "final").exists()

    # the second Ctrl-C: it stops now, without finishing the step or writing a checkpoint
    assert b.returncode != 0
    assert stopped_s < 30, f"took {stopped_s:.0f}s to stop after the second Ctrl-C"
    assert "interrupted after step" not in b.stderr and checkpoint_steps(twice) == []
    assert "grpolab: stopped at once; no checkpoint was written" in b.stderr
    assert not any(r.get("train_step") is not None for r in records(twice)), "the step was finished"

    resumed = Proc(grpolab("grpo", "--resume", once), tmp_path, "resume").ok()
    assert "Traceback" not in resumed.stderr
    assert (once / "final" / "model.safetensors").exists()
    assert sorted(r["train_step"] for r in records(once) if "train_step" in r) == list(range(12))
    assert_no_duplicate_steps(once)


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_a_group_of_one_leaves_the_torchrun_variables_as_it_found_them(monkeypatch):
    """One process asking for an engine makes a gloo group of one on a free port; leaving it puts
    the variables back (unset, or the user's), so a later run in the process picks a new port instead
    of a stale one."""
    import torch.distributed as tdist

    from grpolab.training import distributed

    for key in TORCHRUN_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # the user's: replaced for the group, then back
    for _ in range(2):
        d = distributed.setup("ddp", torch.device("cpu"))
        assert d.enabled and d.owns_group and d.world_size == 1 and tdist.is_initialized()
        assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["RANK"] == "0"
        distributed.teardown()
        assert not tdist.is_initialized() and not distributed.current().enabled
        assert {k: os.environ[k] for k in TORCHRUN_VARIABLES if k in os.environ} == {"MASTER_ADDR": "localhost"}
    with pytest.raises(distributed.DistributedError, match="deepspeed_config nowhere.json"):
        distributed.setup("deepspeed", torch.device("cpu"), deepspeed_config="nowhere.json")
    assert not tdist.is_initialized() and [k for k in TORCHRUN_VARIABLES if k in os.environ] == ["MASTER_ADDR"]
