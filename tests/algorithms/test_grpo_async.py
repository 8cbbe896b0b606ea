"""Asynchronous GRPO (``max_staleness``): 0 is the synchronous loop; k >= 1 trains each step on the
batch a sampler process made under the weights of step ``step - k``, logs the staleness (never
above k) and the waits, corrects with the sampler's log-probs, and composes with DAPO's dynamic
sampling, the reward workers, tools, validation and token records; a sampler process killed
mid-run is one line and the run resumes. (SIGKILL + resume to the uninterrupted weights:
``tests/training/test_run.py``, ``grpo_async``.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from grpolab.algorithms.grpo import GRPOConfig, train_grpo

ROOT = Path(__file__).resolve().parents[2]
DIGIT = "tests.helpers.reward_fixtures:reward_any_digit"  # the random tiny model earns it sometimes: advantages != 0


def steps_of(result) -> list[dict]:
    return [json.loads(line) for line in open(result.metrics_path) if '"train/reward"' in line]


def test_max_staleness_0_is_the_synchronous_loop_bit_for_bit(grpo_config, same_weights, tmp_path):
    plain = train_grpo(grpo_config(reward=DIGIT, run_dir=str(tmp_path / "plain")))
    zero = train_grpo(grpo_config(reward=DIGIT, run_dir=str(tmp_path / "zero"), max_staleness=0))
    from safetensors.torch import load_file

    assert same_weights(load_file(str(Path(plain.final_dir) / "model.safetensors")),
                        load_file(str(Path(zero.final_dir) / "model.safetensors")))
    assert not any(k.startswith("async/") for record in steps_of(zero) for k in record)


@pytest.mark.parametrize("k,extra", [
    (1, {"reward_workers": 1}),  # rewards scored by a worker process, from the producer's thread
    (2, {"dynamic_sampling": True, "max_sampling_rounds": 2, "token_record_groups": 1}),
])
def test_staleness_is_bounded_by_k_and_the_sampler_log_probs_are_the_behaviour_policy(grpo_config, k, extra):
    result = train_grpo(grpo_config(reward=DIGIT, n_grpo_steps=5, max_staleness=k, eval_every=2, **extra))
    steps = steps_of(result)
    assert [s["grpo_step"] for s in steps] == list(range(5))
    for s in steps:
        assert s["async/staleness_max"] == s["async/staleness_mean"] == min(s["grpo_step"], k) <= k
        assert s["async/policy_version"] == max(0, s["grpo_step"] - k)
        assert s["time/trainer_wait_s"] >= 0 and s["time/sampler_wait_s"] >= 0
    stale = [s for s in steps if s["async/staleness_max"] > 0]
    # a stale batch's gap between the sampler's and the trainer's log-probs is the policy's lag, reported as such
    assert all("health/logprob_mismatch" not in s and s["async/behaviour_logprob_gap"] >= 0 for s in stale)
    assert any(s["async/behaviour_logprob_gap"] > 1e-3 for s in stale), "the weights never moved: nothing was tested"
    # the TIS correction is on by default, and measures that the trained weights differ from the sampler's
    assert any(s.get("train/is_ratio_max", 1.0) > 1 + 1e-3 for s in stale)
    evals = [json.loads(line) for line in open(result.metrics_path) if '"eval/accuracy"' in line]
    assert len(evals) >= 2
    if extra.get("dynamic_sampling"):
        assert all("sampling/groups_kept" in s for s in steps)
        records = [json.loads(line) for line in open(Path(result.run_dir) / "tokens.jsonl")]
        assert {r["step"] for r in records} == set(range(5))


def test_async_grpo_with_the_calculator_tool(grpo_config):
    cfg = grpo_config(n_grpo_steps=3, sampling_max_tokens=16, max_staleness=1,
                      env={"tools": ["calculate"], "max_turns": 2, "max_total_tokens": 40})
    steps = steps_of(train_grpo(cfg))
    assert [s["async/staleness_max"] for s in steps] == [0, 1, 1]
    assert all(s["tools/turns"] >= 1.0 for s in steps)


def test_c5_2_async_grpo_starts_its_sampler_with_the_fp32_head_under_bf16(grpo_config):
    """C5-2: dtype bfloat16 + logits_fp32 (what dtype auto gives wherever it picks bf16): the sampler process
    unpickles the fp32 head and trains, the head fp32 on both sides (was: the child died during start)."""
    steps = steps_of(train_grpo(grpo_config(reward=DIGIT, n_grpo_steps=2, max_staleness=1, dtype="bfloat16",
                                            logits_fp32=True, eval_examples=2)))
    assert [s["async/staleness_max"] for s in steps] == [0, 1]


def test_c5_4_async_validation_runs_the_environment_and_the_runs_autocast_as_synchronous(grpo_config, open_run,
                                                                                        tmp_path):
    """C5-4: validation under max_staleness 1 samples as under max_staleness 0: through the tool environment
    (multi-turn rollouts) and under the run's bf16 autocast (was: a bare hf backend, no tools, fp32)."""
    import torch

    from grpolab.algorithms.grpo_async import rollout_source
    from grpolab.training.batching import ExampleSampler
    from grpolab.training.inputs import load_inputs

    seen = {}
    for k in (0, 1):
        cfg = grpo_config(max_staleness=k, dtype="bfloat16", run_dir=str(tmp_path / f"run{k}"),
                          env={"tools": ["calculate"], "max_turns": 2, "max_total_tokens": 40})
        inputs, run = load_inputs(cfg), open_run(cfg)
        source, _ = rollout_source(run, cfg, inputs, None, ExampleSampler(len(inputs.train), 0),
                                   cfg.sampling_params(), torch.Generator().manual_seed(0))
        prompts = [inputs.template.format(e.question) for e in inputs.evals[:2]]
        rollouts = source.eval_backend.generate(prompts, 1, cfg.eval_sampling_params())
        seen[k] = (all("turns" in r.info for r in rollouts), source.eval_backend.autocast_dtype)
    assert seen[1] == seen[0] == (True, torch.bfloat16), seen


@pytest.mark.parametrize("overrides,message", [
    ({"rollout_backend": "vllm"}, "use rollout_backend hf"),
    ({"importance_sampling_correction": "none"}, "would weigh every token as if on-policy"),
    ({"distributed": "ddp"}, "runs in one process"),
])
def test_combinations_async_cannot_run_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(max_staleness=1, **overrides)


@pytest.mark.slow  # make test-slow (test-all), not make test: minutes of real processes
def test_a_killed_sampler_process_stops_the_run_in_one_line_and_it_resumes(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "grpolab", "grpo", "--n-grpo-steps", "8", "--rollout-batch-size", "8",
            "--group-size", "4", "--train-batch-size", "8", "--gradient-accumulation-steps", "1",
            "--sampling-max-tokens", "8", "--sampling-min-tokens", "1", "--eval-examples", "2",
            "--task-train-size", "20", "--warmup-steps", "0", "--learning-rate", "1e-3", "--reward", DIGIT,
            "--max-staleness", "1", "--checkpoint-every", "1", "--show-progress", "false", "--device", "cpu",
            "--run-dir", str(run_dir)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        marker = run_dir / "checkpoints" / "step_1" / "trainer_state.pt"
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.communicate(timeout=60)[1][-2000:]
        children = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(children) == 1, [c.cmdline() for c in children]
        children[0].send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err[-2000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("grpolab: error:")]
    assert len(lines) == 1 and "sampler process died" in lines[0] and "--resume" in lines[0], err[-2000:]
    resumed = subprocess.run([sys.executable, "-m", "grpolab", "grpo", "--resume", str(run_dir)], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (run_dir / "final").is_dir()
