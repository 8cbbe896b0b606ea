"""GRPO, evaluation and resume with ``rollout_backend: vllm`` on a real vLLM engine."""

import json

import pytest
import torch
from safetensors.torch import load_file

from grpolab.algorithms.grpo import train_grpo
from tests.algorithms.test_grpo import step_records
from tests.training.test_run import (
    Proc,
    assert_no_duplicate_steps,
    assert_same_tensors,
    checkpoint_steps,
    grpolab,
    start_and_sigkill,
    train_cmd,
)


def test_grpo_with_vllm_learns_syncs_and_measures_the_sampler_gap(grpo_config):
    cfg = grpo_config(n_grpo_steps=25, rollout_batch_size=64, group_size=8, train_batch_size=64,
                      gradient_accumulation_steps=1, sampling_max_tokens=3, learning_rate=1e-2,
                      reward="tests.helpers.reward_fixtures:starts_with_7", seed=1, rollout_backend="vllm",
                      eval_every=10, sampling_min_tokens=0)  # min_tokens masks the end ids: vLLM's
    # log-probs of those first tokens are then of the renormalised distribution (documented)
    assert cfg.is_correction == "tis"  # on by default for vllm
    result = train_grpo(cfg)
    records = step_records(result)
    rewards = [r["train/reward"] for r in records]
    assert len(rewards) == 25
    assert sum(rewards[:3]) / 3 < 0.2
    assert sum(rewards[-5:]) / 5 > 0.6, rewards  # the engine sampled from the updated weights every step
    for r in records:
        assert r["time/weight_sync_s"] > 0  # every step applied an update, and the engine got it
        assert r["health/logprob_mismatch"] < 1e-4  # fp32 engine vs fp32 trainer: measured ~1e-7
        assert r["train/is_truncated_fraction"] == 0.0 and r["train/is_ratio_max"] < 1.001  # TIS on, nothing to cap
    evals = [json.loads(line) for line in open(result.metrics_path) if '"eval/accuracy"' in line]
    assert len(evals) >= 3  # before, at steps 10 and 20, after: validation sampled through the engine
    assert (result.final_dir / "model.safetensors").exists()


def test_sigkill_then_resume_with_vllm_ends_with_the_uninterrupted_weights(tmp_path):
    extra = ("--rollout-backend", "vllm")
    full = Proc(train_cmd("grpo", tmp_path / "full", *extra), tmp_path, "full")
    full.ok()
    killed = tmp_path / "killed"
    start_and_sigkill(train_cmd("grpo", killed, *extra), killed, tmp_path, "killed")
    resume_from = checkpoint_steps(killed)[-1]
    at_kill = load_file(str(killed / "checkpoints" / f"step_{resume_from}" / "model.safetensors"))
    resumed = Proc(grpolab("grpo", "--resume", killed), tmp_path, "resume").ok()
    assert "Traceback" not in resumed.stderr
    assert_no_duplicate_steps(killed, like=tmp_path / "full")
    final = load_file(str(killed / "final" / "model.safetensors"))
    assert any(not torch.equal(at_kill[k], final[k]) for k in final), "the resumed steps trained nothing"
    assert_same_tensors(tmp_path / "full" / "final" / "model.safetensors", killed / "final" / "model.safetensors")


def test_eval_with_the_vllm_backend_gives_the_hf_backends_greedy_figures(tmp_path):
    figures = {}
    for backend in ("hf", "vllm"):
        out = tmp_path / backend
        Proc(grpolab("eval", "--model", "embedded:tiny", "--data", "task:arithmetic", "--n", "8", "--k", "1",
                     "--temperature", "0", "--max-tokens", "12", "--out", out, "--backend", backend,
                     "--dtype", "float32"),  # both sides: --dtype auto gives vLLM bfloat16
             tmp_path, backend).ok()
        figures[backend] = json.loads((out / "eval.json").read_text())
        generations = [json.loads(line)["response"] for line in open(out / "generations.jsonl")]
        figures[backend]["responses"] = generations
    assert figures["vllm"]["responses"] == figures["hf"]["responses"]
    for key in ("accuracy", "format_rate", "mean_length"):
        assert figures["vllm"][key] == pytest.approx(figures["hf"][key])


def test_grpo_with_a_tool_env_on_vllm_trains_on_the_engines_multi_turn_log_probs(grpo_config, tmp_path, tool_model_dir):
    from grpolab.models import load_model_and_tokenizer
    from tests.helpers.tool_models import ENV, tool_questions

    model, tok = load_model_and_tokenizer(str(tool_model_dir))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(q) + "\n" for q in tool_questions()))
    cfg = grpo_config(task=None, train_data=str(tmp_path / "train.jsonl"), prompt_template="compact", env=ENV,
                      rollout_backend="vllm", n_grpo_steps=3, rollout_batch_size=32, group_size=4, train_batch_size=32,
                      sampling_max_tokens=40, sampling_min_tokens=0, learning_rate=1e-3,
                      sampling_temperature=1.5)  # the SFT model is near-certain at T=1: every group all right
    # and nothing trained; at 1.5 groups vary (measured: 16-24 of 32 rows trained, mismatch ~3e-7)
    records = step_records(train_grpo(cfg, model=model, tokenizer=tok))
    assert len(records) == 3
    assert records[0]["tools/call_rate"] > 0.5  # the SFT model calls the tool, through the engine
    for r in records:  # at T=1.5 and lr 1e-3 the rate drifts (measured 0.97 -> 0.84, or 0.91 -> 0.47, by the SFT
        assert r["tools/call_rate"] > 0 and r["tools/observation_tokens"] > 0  # start): multi-turn every step
        assert r["train/rows_trained"] > 0 and r["time/weight_sync_s"] > 0  # the mismatch is measured on them
        # the engine's log-probs of the model's tokens, with observations in its context, are the
        # trainer's: observation tokens (sampler log-prob 0) are outside the measured mask
        assert r["health/logprob_mismatch"] < 1e-4, r
