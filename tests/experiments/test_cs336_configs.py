"""configs/cs336/ (issue 55): one config per problem of CS336 Assignment 5 (spring 2025), loaded by
grpolab's own config loader, carries the handout's hyperparameters, paths and two-GPU layout; each
GRPO ablation differs from the base config only in its own knob, so a changed default cannot move them."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpolab.algorithms import METHODS

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "cs336"
MATH = "/data/a5-alignment/MATH"

# problem -> (command, the fields that differ from grpo_learning_rate.yaml besides run_dir)
PROBLEMS = {
    "sft_experiment": ("sft", None),
    "expert_iteration_experiment": ("ei", None),
    "grpo_learning_rate": ("grpo", {}),
    "grpo_baselines": ("grpo", {"loss_type": "no_baseline"}),
    "grpo_length_normalization": ("grpo", {"length_normalization": "masked_normalize"}),
    "grpo_group_standard_deviation": ("grpo", {"use_std_normalization": False}),
    "grpo_off_policy_sweep": ("grpo", {"loss_type": "grpo_clip", "epochs_per_rollout_batch": 2,
                                       "train_batch_size": 128, "gradient_accumulation_steps": 64}),
    "grpo_off_policy_clip_ablation": ("grpo", {"loss_type": "grpo_no_clip", "epochs_per_rollout_batch": 2,
                                               "train_batch_size": 128, "gradient_accumulation_steps": 64}),
    "grpo_prompt_ablation": ("grpo", {"prompt_template": "question_only", "reward": "question_only"}),
    "leaderboard": ("grpo", {"eval_examples": 5000}),
}

# CS336 A5 §7.3's starter hyperparameters, AdamW's settings and clipping.
HANDOUT_GRPO = dict(
    n_grpo_steps=200, learning_rate=1e-5, advantage_eps=1e-6, rollout_batch_size=256, group_size=8,
    sampling_temperature=1.0, sampling_min_tokens=4, sampling_max_tokens=1024, epochs_per_rollout_batch=1,
    train_batch_size=256, gradient_accumulation_steps=128, vllm_gpu_memory_utilization=0.85,
    loss_type="reinforce_with_baseline", use_std_normalization=True, length_normalization="masked_mean",
    betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0, warmup_steps=0, lr_schedule="constant",
    kl_coef=0.0, kl_stop=None, importance_sampling_correction="none", prompt_template="r1_zero", reward="r1_zero",
    train_data=f"{MATH}/train.jsonl",
)
# What every run of the assignment shares: the model, validation data, sampling as the handout
# evaluates (temperature 1, top-p 1, 1024 tokens, stop at </answer>), and the two-GPU layout.
SHARED = dict(
    model="/data/a5-alignment/models/Qwen2.5-Math-1.5B", task=None, eval_data=f"{MATH}/validation.jsonl",
    sampling_temperature=1.0, sampling_top_p=1.0, sampling_max_tokens=1024, stop=["</answer>"],
    eval_temperature=1.0, max_grad_norm=1.0, betas=(0.9, 0.95), weight_decay=0.0, dtype="bfloat16", device="cuda:0",
    rollout_backend="vllm_server", vllm_device="cuda:1",
)


def load(problem: str):
    command = PROBLEMS[problem][0]
    return METHODS[command].load()[0].build(CONFIGS / f"{problem}.yaml")


def values(cfg) -> dict:
    return {k: (tuple(v) if k == "betas" else v) for k, v in cfg.model_dump().items()}


def test_one_config_per_problem():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(PROBLEMS)


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_shared_values(problem):
    cfg = values(load(problem))
    assert {k: cfg[k] for k in SHARED} == SHARED
    assert cfg["run_dir"] == f"runs/cs336/{problem}"
    assert cfg["prompt_template"] == ("question_only" if problem == "grpo_prompt_ablation" else "r1_zero")


def test_grpo_base_is_the_handouts():
    cfg = values(load("grpo_learning_rate"))
    assert {k: cfg[k] for k in HANDOUT_GRPO} == HANDOUT_GRPO
    assert cfg["eval_examples"] >= 1024  # the handout: validate on at least 1024 examples


@pytest.mark.parametrize("problem", sorted(p for p, (command, _) in PROBLEMS.items() if command == "grpo"))
def test_each_grpo_ablation_changes_only_its_knob(problem):
    base, cfg = values(load("grpo_learning_rate")), values(load(problem))
    changed = {k: cfg[k] for k in cfg if cfg[k] != base[k] and k != "run_dir"}
    assert changed == PROBLEMS[problem][1]


def test_sft_and_expert_iteration():
    sft = values(load("sft_experiment"))
    assert sft["train_data"] == f"{MATH}/sft.jsonl" and sft["reward"] == "r1_zero"
    ei = values(load("expert_iteration_experiment"))
    assert ei["train_data"] == f"{MATH}/train.jsonl" and ei["n_ei_steps"] == 5
    assert ei["ei_batch_size"] in (512, 1024, 2048) and ei["sampling_min_tokens"] == 4
