"""Issue 20 (round 3): nothing read from a run directory runs code, one writer per run directory,
everything that can fail is checked before the directory is touched, every checkpoint part is
checked before a resume. Crafted payloads write a marker file when (and only when) they run."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpolab.training import distributed, sharded_optimizer
from grpolab.training.checkpoints import STATE_FILE, CheckpointManager
from grpolab.training.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickling it creates ``marker`` (what a crafted checkpoint file would do with os.system)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_pickle(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(Payload(marker)))


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, text
    return text


@pytest.fixture
def as_strategy(monkeypatch):
    """Pretend this (single, plain) process runs under ``strategy`` (no process group needed)."""

    def use(strategy: str, engine=None) -> distributed.Dist:
        d = distributed.Dist(strategy=strategy, engine=engine)
        monkeypatch.setattr(distributed, "_CURRENT", d)
        return d

    return use


def tiny_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(5, 3)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


# ---------------------------------------------------------------- 1. no pickle runs from a run directory


def test_a_crafted_dcp_metadata_does_not_run_on_fsdp2_resume(tmp_path, as_strategy):
    as_strategy("fsdp2")
    model, optimizer = tiny_optimizer()
    marker = tmp_path / "MARKER"
    write_pickle(tmp_path / "ckpt" / "optimizer" / ".metadata", marker)
    with pytest.raises(ValueError) as err:
        sharded_optimizer.load_sharded_optimizer(model, optimizer, tmp_path / "ckpt")
    assert not marker.exists(), "the crafted .metadata ran"
    assert "refused" in one_line(err.value) and "posix.system" in str(err.value)


def test_fsdp2_optimizer_shards_round_trip_through_the_safe_reader(tmp_path, as_strategy):
    as_strategy("fsdp2")
    model, optimizer = tiny_optimizer()
    sharded_optimizer.save_sharded_optimizer(model, optimizer, tmp_path)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.randn(2, 3)).sum().backward()
    fresh.step()  # state exists, and differs
    sharded_optimizer.load_sharded_optimizer(model, fresh, tmp_path)
    a, b = optimizer.state_dict(), fresh.state_dict()
    assert a["param_groups"] == b["param_groups"]  # non-tensor items (read with weights_only=True)
    for k in a["state"]:
        for name, value in a["state"][k].items():
            assert torch.equal(value, b["state"][k][name]), (k, name)


def test_a_crafted_deepspeed_state_does_not_run_on_resume(tmp_path, as_strategy):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class Engine:  # what DeepSpeedEngine.load_checkpoint does with its files: checkpoint_engine.load
        checkpoint_engine = TorchCheckpointEngine()

        def load_checkpoint(self, load_dir, tag, **kwargs):
            for f in sorted((Path(load_dir) / tag).glob("*.pt")):
                self.checkpoint_engine.load(str(f), map_location=torch.device("cpu"))

    as_strategy("deepspeed", Engine())
    marker = tmp_path / "MARKER"
    state = tmp_path / "ckpt" / "deepspeed" / "state"
    state.mkdir(parents=True)
    torch.save({"module": Payload(marker)}, state / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(ValueError) as err:
        sharded_optimizer.load_sharded_optimizer(None, None, tmp_path / "ckpt")
    assert not marker.exists(), "the crafted DeepSpeed state ran"
    assert "refused" in one_line(err.value)
    assert Engine.checkpoint_engine.load.__func__ is TorchCheckpointEngine.load  # put back


def test_the_trainer_state_is_read_without_running_code(tmp_path):
    marker = tmp_path / "MARKER"
    step = tmp_path / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    torch.save({"config": Payload(marker)}, step / STATE_FILE)
    _model_file(step)
    assert CheckpointManager(tmp_path / "checkpoints").latest_loadable() is None
    assert not marker.exists()


# ---------------------------------------------------------------- 4. every checkpoint part is checked


def _model_file(step: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(step / "model.safetensors"))


def _fsdp2_checkpoint(root: Path, n: int, model, optimizer) -> Path:
    step = root / f"step_{n}"
    step.mkdir(parents=True)
    _model_file(step)
    torch.save({"config": {"distributed": "fsdp2"}, "counters": {"step": n}}, step / STATE_FILE)
    sharded_optimizer.save_sharded_optimizer(model, optimizer, step)
    return step


def test_an_fsdp2_checkpoint_missing_its_optimizer_shards_is_moved_aside(tmp_path, as_strategy, capsys):
    as_strategy("fsdp2")
    model, optimizer = tiny_optimizer()
    root = tmp_path / "checkpoints"
    _fsdp2_checkpoint(root, 1, model, optimizer)
    newest = _fsdp2_checkpoint(root, 2, model, optimizer)
    for shard in (newest / "optimizer").glob("*.distcp"):
        shard.unlink()
    found = CheckpointManager(root).latest_loadable()
    assert found is not None and found[0].name == "step_1"
    assert (root / "unreadable_step_2").is_dir()
    assert "optimizer shard" in capsys.readouterr().err


def test_a_truncated_optimizer_shard_or_crafted_metadata_is_moved_aside(tmp_path, as_strategy):
    as_strategy("fsdp2")
    model, optimizer = tiny_optimizer()
    root = tmp_path / "checkpoints"
    _fsdp2_checkpoint(root, 1, model, optimizer)
    truncated = _fsdp2_checkpoint(root, 2, model, optimizer)
    shard = next((truncated / "optimizer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    crafted = _fsdp2_checkpoint(root, 3, model, optimizer)
    marker = tmp_path / "MARKER"
    write_pickle(crafted / "optimizer" / ".metadata", marker)
    found = CheckpointManager(root).latest_loadable()
    assert found is not None and found[0].name == "step_1"
    assert not marker.exists()


def test_a_deepspeed_checkpoint_missing_a_rank_is_moved_aside(tmp_path, as_strategy, capsys):
    as_strategy("deepspeed")
    root = tmp_path / "checkpoints"
    for n in (1, 2):
        step = root / f"step_{n}"
        (step / "deepspeed" / "state").mkdir(parents=True)
        _model_file(step)
        torch.save({"config": {"distributed": "deepspeed"}}, step / STATE_FILE)
        for kind in ("model", "optim"):
            if n == 2 and kind == "optim":
                continue
            torch.save({"x": torch.ones(1)},
                       step / "deepspeed" / "state" / f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt")
    found = CheckpointManager(root).latest_loadable()
    assert found is not None and found[0].name == "step_1"
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing" in capsys.readouterr().err


# ---------------------------------------------------------------- 2. one writer per run directory


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}


SFT = [sys.executable, "-m", "grpolab", "sft", "--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--model",
       "embedded:tiny", "--train-batch-size", "2", "--eval-examples", "2", "--eval-every", "0", "--task-train-size",
       "16", "--show-progress", "false", "--log-generations-samples", "0", "--warmup-steps", "0"]


def _grpolab(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("grpolab:")]


@pytest.mark.slow  # make test-slow (test-all), not make test: minutes of real processes
def test_a_live_run_directory_is_refused_to_a_second_run_resume_and_overwrite(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen([*SFT, "--n-sft-steps", "100000", "--checkpoint-every", "2", "--keep-last", "1",
                              "--run-dir", str(run_dir)], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not list((run_dir / "checkpoints").glob("step_*/" + STATE_FILE)):
            assert first.poll() is None, first.stderr.read()[-2000:]
            time.sleep(0.2)
        assert list((run_dir / "checkpoints").glob("step_*")), "the first run wrote no checkpoint"
        metrics = (run_dir / "metrics.jsonl").read_text()
        assert metrics
        busy = re.compile(rf"^grpolab: error: run_dir {re.escape(str(run_dir))} is in use by another grpolab "
                          rf"process \(pid {first.pid}\)")
        for extra in ([], ["--overwrite"]):
            done = _grpolab([*SFT, "--n-sft-steps", "3", "--run-dir", str(run_dir), *extra])
            assert done.returncode == 2, done.stderr[-2000:]
            lines = _error_lines(done.stderr)
            assert len(lines) == 1 and busy.match(lines[0]), done.stderr[-2000:]
        done = _grpolab([*SFT[:4], "--resume", str(run_dir)])
        assert done.returncode == 2 and len(_error_lines(done.stderr)) == 1, done.stderr[-2000:]
        assert busy.match(_error_lines(done.stderr)[0])
        assert (run_dir / "metrics.jsonl").read_text().startswith(metrics), "a refused run touched the metrics"
        assert first.poll() is None, "the first run died"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # the kernel dropped the SIGKILLed holder's lock: the run continues (its lock file is still there)
    assert (run_dir / ".lock").exists()
    newest = max(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit())
    done = _grpolab([*SFT[:4], "--resume", str(run_dir), "--n-sft-steps", str(newest + 1)])
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(rf"^grpolab: resuming from {re.escape(str(run_dir))}/checkpoints/step_{newest}$", done.stderr,
                     re.M), done.stderr[-2000:]
    assert (run_dir / "final").is_dir()


def test_the_lock_is_released_after_a_failed_and_a_finished_run_in_one_process(tmp_path):
    from grpolab.algorithms.sft import SFTConfig, train_sft
    from grpolab.training.run_dir import RunLock

    run_dir = tmp_path / "run"
    cfg = SFTConfig.build(ROOT / "configs" / "sft_tiny.yaml", {
        "n_sft_steps": 1, "train_batch_size": 2, "eval_examples": 1, "eval_every": 0, "task_train_size": 4,
        "show_progress": False, "log_generations_samples": 0, "warmup_steps": 0, "run_dir": str(run_dir),
        "env": {"tools": ["search"], "corpus": str(tmp_path / "no_corpus.jsonl")}})
    with pytest.raises((ValueError, FileNotFoundError, ConfigError)):
        train_sft(cfg)
    assert not run_dir.exists()  # created for the lock, removed again: nothing was left behind
    train_sft(SFTConfig.build(None, {**cfg.to_dict(), "env": None}))
    RunLock(run_dir).acquire().release()  # free again


# ---------------------------------------------------------------- 3. checked before the directory is touched


def _finished_run(run_dir: Path) -> None:
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "model.safetensors").write_text("x")
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"sft_step": 0}\n')


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_overwrite_with_a_bad_env_leaves_the_finished_run_alone(tmp_path, command):
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo
    from grpolab.algorithms.sft import SFTConfig, train_sft

    run_dir = tmp_path / "run"
    _finished_run(run_dir)
    cls, train = {"sft": (SFTConfig, train_sft), "grpo": (GRPOConfig, train_grpo)}[command]
    overrides = {"run_dir": str(run_dir), "eval_examples": 1, "task_train_size": 8, "show_progress": False,
                 "env": {"tools": ["search"], "corpus": str(tmp_path / "moved_away.jsonl")}}
    if command == "sft":
        overrides.update(n_sft_steps=1, train_batch_size=2)
    cfg = cls.build(ROOT / "configs" / f"{command}_tiny.yaml", overrides)
    with pytest.raises(Exception) as err:
        train(cfg, overwrite=True)
    assert "moved_away" in str(err.value) or "corpus" in str(err.value), err.value
    assert (run_dir / "final" / "model.safetensors").exists(), "--overwrite deleted final/ before the env failed"
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    assert (run_dir / "metrics.jsonl").read_text() == '{"sft_step": 0}\n'


def test_overwrite_with_impossible_backend_options_leaves_the_finished_run_alone(tmp_path):
    """vLLM's options are checked before the directory is touched: without vLLM here (the light
    suite's venv) it is the missing package, with it (a CPU) sleep mode without CUDA."""
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo

    run_dir = tmp_path / "run"
    _finished_run(run_dir)
    cfg = GRPOConfig.build(ROOT / "configs" / "grpo_tiny.yaml", {
        "run_dir": str(run_dir), "eval_examples": 1, "task_train_size": 8, "show_progress": False,
        "rollout_backend": "vllm", "vllm_enable_sleep_mode": True})
    with pytest.raises(ValueError, match="rollout_backend 'vllm'|vllm_enable_sleep_mode needs a CUDA GPU"):
        train_grpo(cfg, overwrite=True)
    assert (run_dir / "final" / "model.safetensors").exists(), "--overwrite deleted final/ before the backend failed"
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    assert (run_dir / "metrics.jsonl").read_text() == '{"sft_step": 0}\n'


def test_a_reward_module_that_exits_at_import_is_one_line_and_nothing_is_touched(tmp_path):
    (tmp_path / "exits_at_import.py").write_text("import os\nos._exit(3)\ndef fn(r, g):\n    return {'reward': 0.0}\n")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpolab", "grpo", "--config", str(ROOT / "configs" / "grpo_tiny.yaml"),
           "--reward", "exits_at_import:fn", "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = _error_lines(done.stderr)
    assert len(lines) == 1 and "exits_at_import" in lines[0] and "exit code 3" in lines[0], done.stderr[-2000:]
    assert not run_dir.exists()


def test_a_reward_module_that_blocks_at_import_is_one_line_and_nothing_is_touched(tmp_path):
    (tmp_path / "blocks_at_import.py").write_text("import time\ntime.sleep(3600)\ndef fn(r, g):\n    return {}\n")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpolab", "grpo", "--config", str(ROOT / "configs" / "grpo_tiny.yaml"),
           "--reward", "blocks_at_import:fn", "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(GRPOLAB_IMPORT_TIMEOUT_S="3"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = _error_lines(done.stderr)
    assert len(lines) == 1 and "blocks_at_import" in lines[0] and "did not finish" in lines[0], done.stderr[-2000:]
    assert not run_dir.exists()


def test_a_custom_tool_module_is_probed_too(tmp_path, monkeypatch):
    from grpolab.training.preflight import check_imports

    (tmp_path / "tool_exits.py").write_text("import os\nos._exit(4)\n")
    monkeypatch.chdir(tmp_path)

    class Cfg:
        reward = "r1_zero"
        env = {"tools": ["calculate", "tool_exits:run"]}

    with pytest.raises(ConfigError) as err:
        check_imports(Cfg())
    assert "custom tool 'tool_exits:run'" in one_line(err.value) and "exit code 4" in str(err.value)


def test_compare_steps_zero_is_refused_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from grpolab.cli import app

    out = CliRunner().invoke(app, ["compare", "--steps", "0", "--run-dir", str(tmp_path / "c")])
    assert out.exit_code == 2
    assert "--steps must be at least 1" in out.output
    assert not (tmp_path / "c").exists()
