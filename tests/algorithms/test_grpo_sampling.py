"""DAPO dynamic sampling and reward shaping in the sampling phase (algorithms/grpo_sampling.py), and the
trainer options around it: truncation masking, the sample budget, the IS correction."""

import warnings

import pytest
import torch

from grpolab.algorithms.grpo import GRPOConfig, train_grpo
from grpolab.algorithms.grpo_sampling import sample_groups
from grpolab.data import Example, load_template
from grpolab.models import load_model_and_tokenizer
from grpolab.rewards import RewardScorer
from grpolab.rollout import HFRolloutBackend, SamplingParams
from grpolab.training.batching import ExampleSampler
from grpolab.training.inputs import Inputs
from grpolab.training.metric_logging import read_metrics


def parity_reward(response, ground_truth):
    """1 for an even-length response: groups of one prompt mostly vary, but not always."""
    r = float(len(response) % 2 == 0)
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


def _setup(group_size=4, n_examples=40):
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    backend = HFRolloutBackend(model, tok, generator=torch.Generator().manual_seed(0))
    examples = [Example(f"{i}+{i}", str(2 * i)) for i in range(n_examples)]
    inputs = Inputs(examples, [], load_template("compact"), parity_reward)
    return backend, inputs, tok


def _cfg(**kw):
    base = dict(rollout_batch_size=16, group_size=4, train_batch_size=16, gradient_accumulation_steps=1,
                sampling_max_tokens=6, sampling_min_tokens=1, device="cpu", show_progress=False, task_train_size=20)
    return GRPOConfig(**{**base, **kw})


def test_dynamic_sampling_keeps_only_groups_whose_rewards_vary():
    backend, inputs, _ = _setup()
    cfg = _cfg(dynamic_sampling=True, max_sampling_rounds=6)
    with RewardScorer(parity_reward, timeout_s=0, isolation="inprocess") as scorer:
        groups = sample_groups(backend, scorer, ExampleSampler(len(inputs.train), 0), inputs, cfg,
                               SamplingParams(max_tokens=6, min_tokens=1))
    s = groups.stats
    assert len(groups.rollouts) == 16 and len(groups.examples) == 4
    per_group = groups.rewards.view(4, 4)
    kept = s["sampling/groups_kept"]
    assert kept + s["sampling/groups_filled"] == 4
    # the kept groups come first and each has reward variance; filled ones have none
    assert all(per_group[g].max() > per_group[g].min() for g in range(kept))
    assert all(per_group[g].max() == per_group[g].min() for g in range(kept, 4))
    assert (s["sampling/groups_drawn"] == s["sampling/rounds"] * 4
            and groups.samples_drawn == s["sampling/groups_drawn"] * 4)
    assert s["sampling/groups_dropped"] + kept + s["sampling/groups_unused"] == s["sampling/groups_drawn"]
    # each rollout points at its own group's example, in prompt-major order
    assert [r.prompt_index for r in groups.rollouts] == [g for g in range(4) for _ in range(4)]
    assert all(r.prompt == inputs.template.format(groups.examples[r.prompt_index].question) for r in groups.rollouts)


def test_without_dynamic_sampling_one_round_is_drawn():
    backend, inputs, _ = _setup()
    with RewardScorer(parity_reward, timeout_s=0, isolation="inprocess") as scorer:
        groups = sample_groups(backend, scorer, ExampleSampler(len(inputs.train), 0), inputs, _cfg(),
                               SamplingParams(max_tokens=6, min_tokens=1))
    assert groups.samples_drawn == 16 and groups.stats == {}
    assert torch.equal(groups.rewards,
                       torch.tensor([parity_reward(r.response, None)["reward"] for r in groups.rollouts]))


def test_overlong_shaping_penalises_only_the_last_buffer_tokens():
    backend, inputs, _ = _setup()
    cfg = _cfg(overlong_buffer_len=2, overlong_penalty_factor=1.0)
    with RewardScorer(parity_reward, timeout_s=0, isolation="inprocess") as scorer:
        groups = sample_groups(backend, scorer, ExampleSampler(len(inputs.train), 0), inputs, cfg,
                               SamplingParams(max_tokens=6, min_tokens=1))
    for r, reward in zip(groups.rollouts, groups.rewards.tolist()):
        n = len(r.response_ids)
        penalty = 0.0 if n <= 4 else -(n - 4) / 2
        assert reward == pytest.approx(parity_reward(r.response, None)["reward"] + penalty)


def test_sample_budget_ends_the_run_and_the_is_ratio_is_one_for_hf(tmp_path):
    cfg = _cfg(n_grpo_steps=10, max_rollout_samples=32, eval_examples=2, log_generations_samples=0, learning_rate=1e-3,
               warmup_steps=0, run_dir=str(tmp_path / "run"), importance_sampling_correction="tis",
               skip_zero_advantage=False)  # every row reaches the loss, so the ratio is measured on every one
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train_grpo(cfg)
    train = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert [r["train/samples_drawn"] for r in train] == [16, 32]  # the budget of 32 samples ends the run
    # the hf sampler is the trainer: the IS ratio is 1 up to float error, so nothing is truncated
    measured = [r for r in train if "train/is_ratio_mean" in r]
    assert len(measured) == len(train)
    assert all(abs(r["train/is_ratio_mean"] - 1) < 1e-4 and r["train/is_truncated_fraction"] == 0 for r in measured)


def test_truncated_completions_leave_the_loss(tmp_path):
    """Every response is cut at 2 tokens: with the mask no row trains and the weights stay; without
    it the same run moves them."""
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = _cfg(n_grpo_steps=2, sampling_max_tokens=2, sampling_min_tokens=2, eval_examples=2, log_generations_samples=0,
               learning_rate=1e-2, warmup_steps=0, reward="tests.helpers.reward_fixtures:reward_any_digit",
               skip_zero_advantage=False, mask_truncated_completions=True, run_dir=str(tmp_path / "masked"))
    result = train_grpo(cfg, model=model, tokenizer=tok)
    train = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert all(r["health/truncation_rate"] == 1.0 and r["train/rows_trained"] == 0 for r in train)
    assert all(torch.equal(start[k], v) for k, v in model.state_dict().items())
    unmasked = cfg.model_copy(update={"mask_truncated_completions": False, "run_dir": str(tmp_path / "plain")})
    model2, tok2 = load_model_and_tokenizer("embedded:tiny", seed=0)
    train_grpo(unmasked, model=model2, tokenizer=tok2)
    assert any(not torch.equal(start[k], v) for k, v in model2.state_dict().items())
