"""GRPO trainer: learning, variants, micro-batching equality, resume, config errors, health."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpolab.algorithms.config import ConfigError
from grpolab.algorithms.grpo import GRPOConfig, accumulate_policy_gradient, make_rollout_batch, train_grpo
from grpolab.algorithms.metrics import read_metrics
from grpolab.core import build_sequences, normalize_group_rewards
from grpolab.models import load_model_and_tokenizer
from grpolab.rollout import HFRolloutBackend, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def starts_with_7(response, ground_truth):
    r = float(response.startswith("7"))
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


def always_zero(response, ground_truth):
    return {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}


def small_cfg(tmp_path, **kw):
    base = dict(n_grpo_steps=3, rollout_batch_size=16, group_size=4, train_batch_size=16, gradient_accumulation_steps=2,
                sampling_max_tokens=6, sampling_min_tokens=1, learning_rate=1e-3, warmup_steps=0, eval_examples=4,
                log_generations_samples=2, run_dir=str(tmp_path / "run"), show_progress=False, task_train_size=50, device="cpu")
    base.update(kw)
    return GRPOConfig(**base)


def test_learns_a_trivially_learnable_reward(tmp_path):
    cfg = small_cfg(tmp_path, n_grpo_steps=25, rollout_batch_size=64, group_size=8, train_batch_size=64,
                    gradient_accumulation_steps=1, sampling_max_tokens=3, learning_rate=1e-2,
                    reward="tests.reward_fixtures:starts_with_7", seed=1)
    result = train_grpo(cfg)
    rewards = [r["train/reward"] for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert len(rewards) == 25
    assert sum(rewards[:3]) / 3 < 0.2
    assert sum(rewards[-5:]) / 5 > 0.6, rewards
    final = result.final_dir
    assert (final / "model.safetensors").exists() and (final / "tokenizer.json").exists()
    assert (result.run_dir / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("variant", [
    dict(loss_type="reinforce_with_baseline"),
    dict(loss_type="grpo_clip", epochs_per_rollout_batch=2, train_batch_size=8, gradient_accumulation_steps=2),
    dict(loss_type="no_baseline", length_normalization="masked_normalize"),
    dict(loss_type="grpo_no_clip", epochs_per_rollout_batch=2, length_normalization="token_mean", cliprange_high=0.28),
    dict(kl_coef=0.2, kl_adaptive=True, kl_target=0.01, loss_type="grpo_clip", epochs_per_rollout_batch=2,
         micro_batch_token_budget=64),
])
def test_variants_run_and_log(tmp_path, variant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train_grpo(small_cfg(tmp_path, **variant))
    records = read_metrics(result.metrics_path)
    train = [r for r in records if "train_step" in r]
    per_rollout = (16 // small_cfg(tmp_path, **variant).train_batch_size) * variant.get("epochs_per_rollout_batch", 1)
    assert len(train) <= 3 * per_rollout and len(train) >= 3
    assert [r["train_step"] for r in train] == list(range(len(train)))
    for key in ("train/loss", "train/grad_norm", "train/token_entropy", "train/clip_fraction", "train/lr",
                "train/kl_coef"):
        assert all(key in r for r in train)
    first = [r for r in train if "train/reward" in r]
    for key in ("train/reward", "train/format_reward", "train/answer_reward", "train/response_length",
                "health/zero_variance_group_fraction", "health/truncation_rate", "health/format_failure_rate",
                "health/wrong_answer_rate", "health/reward_errors", "health/logprob_mismatch",
                "time/rollout_s", "time/train_s", "time/tokens_per_s"):
        assert all(key in r for r in first), key
    assert all(r["health/logprob_mismatch"] < 1e-3 for r in first)
    evals = [r for r in records if "eval_step" in r]
    assert [r["eval_step"] for r in evals] == [0, 1] and "eval/accuracy" in evals[0]
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in train)
    if variant.get("kl_coef"):
        assert all(0.1 <= r["train/kl_coef"] <= 0.3 for r in train) and "train/kl" in train[0]
    assert (result.run_dir / "samples" / "eval_step_3.jsonl").exists()
    sample = json.loads((result.run_dir / "samples" / "eval_step_3.jsonl").read_text().splitlines()[0])
    assert {"prompt", "response", "ground_truth", "reward", "mean_token_entropy", "length"} <= set(sample)


# ---------------------------------------------------------------- gradient equality
def _rollout_batch(group_size=4, n_prompts=4, seed=0):
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=seed)
    backend = HFRolloutBackend(model, tok)
    prompts = [f"Q: {i}+{i}\nA: <think>" for i in range(n_prompts)]
    rollouts = backend.generate(prompts, group_size, SamplingParams(max_tokens=12, min_tokens=1, seed=seed))
    raw = torch.tensor([float(len(r.response_ids) % 3 == 0) for r in rollouts])
    raw[:group_size] = 1.0  # one zero-variance group
    batch = make_rollout_batch(rollouts, raw, normalize_group_rewards(raw, group_size, 1e-6, True), tok.pad_token_id)
    return model, batch, True


def _grad(model, batch, cfg, contributes, shared=False):
    """The gradient of one optimizer batch over every row; ``shared``: each prompt run once."""
    model.zero_grad(set_to_none=True)
    from contextlib import nullcontext

    n = batch.labels.shape[0]
    cfg = cfg.model_copy(update={"share_prompt_prefix": bool(shared)})
    accumulate_policy_gradient(model, batch, list(range(n)), cfg, contributes, 0.0, torch.device("cpu"), nullcontext)
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


@pytest.mark.parametrize("mode", ["masked_mean", "masked_normalize", "token_mean"])
def test_dynamic_microbatching_and_skipping_leave_the_gradient_unchanged(tmp_path, mode):
    model, batch, sequences = _rollout_batch()
    n = batch.labels.shape[0]
    fixed = small_cfg(tmp_path, rollout_batch_size=n, train_batch_size=n, gradient_accumulation_steps=4,
                      length_normalization=mode, skip_zero_advantage=False)
    all_rows = torch.ones(n, dtype=torch.bool)
    reference = _grad(model, batch, fixed, all_rows)
    assert reference.abs().sum() > 0
    dynamic = fixed.model_copy(update={"micro_batch_token_budget": 40})
    assert torch.allclose(_grad(model, batch, dynamic, all_rows), reference, atol=1e-6)
    one_big = fixed.model_copy(update={"gradient_accumulation_steps": 1})
    assert torch.allclose(_grad(model, batch, one_big, all_rows), reference, atol=1e-6)
    skip = batch.advantages != 0
    assert not skip.all()
    assert torch.allclose(_grad(model, batch, dynamic, skip), reference, atol=1e-6)
    # each prompt computed once for its group: the same gradient
    assert torch.allclose(_grad(model, batch, fixed, all_rows, sequences), reference, atol=1e-6)
    assert torch.allclose(_grad(model, batch, dynamic, skip, sequences), reference, atol=1e-6)
    assert torch.allclose(_grad(model, batch, one_big, skip, sequences), reference, atol=1e-6)


def test_empty_response_never_reaches_the_loss_as_nan(tmp_path):
    model, batch, _ = _rollout_batch()
    n = batch.labels.shape[0]
    batch.response_mask[1] = False  # row 1 as if the response were empty
    cfg = small_cfg(tmp_path, rollout_batch_size=n, train_batch_size=n, gradient_accumulation_steps=2)
    contributes = batch.response_mask.any(1)
    g = _grad(model, batch, cfg, contributes)
    assert torch.isfinite(g).all()


def test_zero_variance_everywhere_gives_zero_update_and_a_diagnosis(tmp_path, capsys):
    cfg = small_cfg(tmp_path, n_grpo_steps=3, health_window=2, reward="tests.reward_fixtures:always_zero")
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train_grpo(cfg, model=model, tokenizer=tok)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    train = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert all(r["health/zero_variance_group_fraction"] == 1.0 for r in train)
    assert all(r["train/loss"] == 0.0 and r["train/grad_norm"] == 0.0 for r in train)
    err = capsys.readouterr()
    assert "No learning signal" in err.out + err.err
    stop = cfg.model_copy(update={"stop_on_unhealthy": True, "run_dir": str(tmp_path / "stop")})
    from grpolab.algorithms.health import UnhealthyRunError

    with pytest.raises(UnhealthyRunError, match="No learning signal"):
        train_grpo(stop)


# ---------------------------------------------------------------- config errors
@pytest.mark.parametrize("over,message", [
    (dict(train_batch_size=10, gradient_accumulation_steps=4), "train_batch_size (10) must be divisible by gradient_accumulation_steps (4)"),
    (dict(rollout_batch_size=10, group_size=4), "rollout_batch_size (10) must be divisible by group_size (4)"),
    (dict(learning_rate=-1), "'learning_rate'"),
    (dict(loss_type="ppo"), "'loss_type'"),
    (dict(banana=1), "unknown key 'banana'"),
])
def test_config_errors_name_the_key(over, message):
    with pytest.raises(ConfigError) as err:
        GRPOConfig.build(None, over)
    assert message in str(err.value)


def test_grpo_clip_on_policy_warns():
    with pytest.warns(UserWarning, match="on-policy"):
        GRPOConfig(loss_type="grpo_clip")


def test_yaml_errors_and_cli_exit_codes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_grpo_steps: 3\nfoo: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        GRPOConfig.build(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("n_grpo_steps: 3\ngroup_sise: 4\n")
    proc = subprocess.run([sys.executable, "-m", "grpolab.cli", "grpo", "--config", str(unknown)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "unknown key 'group_sise'" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "grpolab.cli", "grpo", "--group-size", "3"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "rollout_batch_size (256) must be divisible by group_size (3)" in proc.stderr


def test_shipped_configs_validate():
    from grpolab.algorithms.dpo import DPOConfig
    from grpolab.algorithms.expert_iteration import EIConfig
    from grpolab.algorithms.ppo import PPOConfig
    from grpolab.algorithms.sft import SFTConfig

    classes = {"grpo": GRPOConfig, "sft": SFTConfig, "ppo": PPOConfig, "dpo": DPOConfig, "ei": EIConfig}
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(paths) >= 6
    for path in paths:
        classes[path.name.split("_")[0]].build(path)


# ---------------------------------------------------------------- resume after SIGKILL
def _cli(run_dir, *extra):
    return [sys.executable, "-m", "grpolab.cli", "grpo", "--config", str(ROOT / "configs" / "grpo_tiny.yaml"),
            "--run-dir", str(run_dir), "--n-grpo-steps", "8", "--checkpoint-every", "2", "--eval-examples", "4",
            "--show-progress", "false", "--deterministic", "true", *extra]


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = subprocess.run(_cli(tmp_path / "full"), capture_output=True, text=True, env=env, cwd=ROOT)
    assert full.returncode == 0, full.stderr
    run = tmp_path / "killed"
    proc = subprocess.Popen(_cli(run), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoints" / "step_2" / "trainer_state.pt").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "final").exists(), "the run finished before it could be killed"
    resumed = subprocess.run([sys.executable, "-m", "grpolab.cli", "grpo", "--resume", str(run)],
                             capture_output=True, text=True, env=env, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr
    a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    b = load_file(run / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [r["train_step"] for r in read_metrics(run / "metrics.jsonl") if "train_step" in r]
    assert steps[-1] == 7


def test_grpo_and_sft_on_local_jsonl_files_with_custom_fields(tmp_path):
    from grpolab.algorithms.sft import SFTConfig, train_sft

    data = tmp_path / "questions.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"problem_text": f"{i}+1", "solution_value": i + 1}) + "\n")
        f.write("{broken\n")
    cfg = small_cfg(tmp_path, task=None, train_data=str(data), eval_data=str(data), data_format="jsonl",
                    question_field="problem_text", answer_field="solution_value", data_on_error="skip",
                    prompt_template="compact", reward="r1_zero_lenient", n_grpo_steps=1)
    with pytest.warns(UserWarning, match="skipped 1"):
        result = train_grpo(cfg)
    assert any("train/reward" in r for r in read_metrics(result.metrics_path))
    strict = cfg.model_copy(update={"data_on_error": "raise", "run_dir": str(tmp_path / "strict")})
    from grpolab.data import DataError

    with pytest.raises(DataError, match=r"questions.jsonl:17: invalid JSON"):
        train_grpo(strict)
    gsm = tmp_path / "mini_gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "Q?", "answer": "1 + 1 = <<1+1=2>>2\n#### 2"}) + "\n")
    sft = train_sft(SFTConfig(task=None, train_data=str(gsm), n_sft_steps=1, train_batch_size=1,
                              gradient_accumulation_steps=1, prompt_template="r1_zero", run_dir=str(tmp_path / "sft"),
                              show_progress=False, device="cpu"))
    assert sft.n_examples == 1
