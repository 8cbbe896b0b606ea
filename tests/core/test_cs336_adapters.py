"""scripts/cs336_adapters.py (issue 55): the official CS336 A5 ``tests/adapters.py`` answered by
grpolab.core. Each adapter, called as the official tests call it (positionally, in the official
parameter order), gives what the grpolab.core function gives on the same random tensors."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from grpolab import core

ROOT = Path(__file__).resolve().parents[2]

# The official adapters' parameter names, in order (stanford-cs336/assignment5-alignment, tests/adapters.py).
OFFICIAL = {
    "run_tokenize_prompt_and_output": ["prompt_strs", "output_strs", "tokenizer"],
    "run_compute_group_normalized_rewards": ["reward_fn", "rollout_responses", "repeated_ground_truths", "group_size",
                                             "advantage_eps", "normalize_by_std"],
    "run_compute_entropy": ["logits"],
    "run_get_response_log_probs": ["model", "input_ids", "labels", "return_token_entropy"],
    "run_compute_naive_policy_gradient_loss": ["raw_rewards_or_advantages", "policy_log_probs"],
    "run_compute_grpo_clip_loss": ["advantages", "policy_log_probs", "old_log_probs", "cliprange"],
    "run_compute_policy_gradient_loss": ["policy_log_probs", "loss_type", "raw_rewards", "advantages",
                                         "old_log_probs", "cliprange"],
    "run_masked_mean": ["tensor", "mask", "dim"],
    "run_sft_microbatch_train_step": ["policy_log_probs", "response_mask", "gradient_accumulation_steps",
                                      "normalize_constant"],
    "run_grpo_microbatch_train_step": ["policy_log_probs", "response_mask", "gradient_accumulation_steps",
                                       "loss_type", "raw_rewards", "advantages", "old_log_probs", "cliprange"],
    "run_masked_normalize": ["tensor", "mask", "dim", "normalize_constant"],
    "get_packed_sft_dataset": ["tokenizer", "dataset_path", "seq_length", "shuffle"],
    "run_iterate_batches": ["dataset", "batch_size", "shuffle"],
    "run_parse_mmlu_response": ["mmlu_example", "model_output"],
    "run_parse_gsm8k_response": ["model_output"],
    "run_compute_per_instance_dpo_loss": ["lm", "lm_ref", "tokenizer", "beta", "prompt", "response_chosen",
                                          "response_rejected"],
}


@pytest.fixture(scope="module")
def adapters():
    spec = importlib.util.spec_from_file_location("cs336_adapters", ROOT / "scripts" / "cs336_adapters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        assert a == b


def test_every_official_adapter_is_there_with_its_parameters(adapters):
    for name, params in OFFICIAL.items():
        assert list(inspect.signature(getattr(adapters, name)).parameters) == params, name


def test_masked_normalize_and_mean_take_the_official_order(adapters):
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(3, 7, generator=g), torch.rand(3, 7, generator=g) > 0.4
    for dim in (None, 0, 1, -1):
        # official order (tensor, mask, dim, normalize_constant); grpolab's (tensor, mask, normalize_constant, dim)
        _same(adapters.run_masked_normalize(x, mask, dim, 3.0), core.masked_normalize(x, mask, 3.0, dim))
        _same(adapters.run_masked_mean(x, mask, dim), core.masked_mean(x, mask, dim))
    assert not torch.equal(adapters.run_masked_normalize(x, mask, 1, 3.0), adapters.run_masked_normalize(x, mask, 1))


def test_losses_entropy_and_advantages_equal_grpolab_core(adapters):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g)
    _same(adapters.run_compute_entropy(logits), core.compute_entropy(logits))
    logp, old = -torch.rand(4, 6, generator=g), -torch.rand(4, 6, generator=g)
    adv, raw = torch.randn(4, 1, generator=g), torch.rand(4, 1, generator=g)
    _same(adapters.run_compute_naive_policy_gradient_loss(adv, logp),
          core.compute_naive_policy_gradient_loss(adv, logp))
    _same(adapters.run_compute_grpo_clip_loss(adv, logp, old, 0.2), core.compute_grpo_clip_loss(adv, logp, old, 0.2))
    for loss_type in ("no_baseline", "reinforce_with_baseline", "grpo_clip"):
        _same(adapters.run_compute_policy_gradient_loss(logp, loss_type, raw, adv, old, 0.2),
              core.compute_policy_gradient_loss(logp, loss_type, raw, adv, old, 0.2))

    def reward_fn(response, truth):
        return {"reward": float(response == truth), "format_reward": 1.0, "answer_reward": float(response == truth)}

    responses, truths = ["1", "2", "2", "2", "3", "1"], ["2"] * 3 + ["1"] * 3
    for by_std in (True, False):
        _same(adapters.run_compute_group_normalized_rewards(reward_fn, responses, truths, 3, 1e-6, by_std),
              core.compute_group_normalized_rewards(reward_fn, responses, truths, 3, 1e-6, by_std))


def _train_step(step, *args, **kwargs):
    """(loss, metadata, gradient) of a micro-batch step on fresh leaf log-probs."""
    g = torch.Generator().manual_seed(2)
    logp = (-torch.rand(4, 6, generator=g)).requires_grad_()
    mask = torch.rand(4, 6, generator=g) > 0.3
    loss, meta = step(logp, mask, *args, **kwargs)
    return loss, meta, logp.grad


def test_train_steps_equal_grpolab_core(adapters):
    _same(_train_step(adapters.run_sft_microbatch_train_step, 4, 5.0),
          _train_step(core.sft_microbatch_train_step, 4, 5.0))
    g = torch.Generator().manual_seed(3)
    adv, raw, old = torch.randn(4, 1, generator=g), torch.rand(4, 1, generator=g), -torch.rand(4, 6, generator=g)
    for loss_type in ("no_baseline", "reinforce_with_baseline", "grpo_clip"):
        _same(_train_step(adapters.run_grpo_microbatch_train_step, 2, loss_type, raw, adv, old, 0.2),
              _train_step(core.grpo_microbatch_train_step, 2, loss_type, raw, adv, old, 0.2))


def test_tokenize_and_log_probs_equal_grpolab_core(adapters, tiny_model):
    model, tokenizer = tiny_model()
    prompts, outputs = ["1+2=", "10+20="], ["3", "30 done"]
    batch = adapters.run_tokenize_prompt_and_output(prompts, outputs, tokenizer)
    _same(batch, core.tokenize_prompt_and_output(prompts, outputs, tokenizer))
    with torch.no_grad():
        _same(adapters.run_get_response_log_probs(model, batch["input_ids"], batch["labels"], True),
              core.get_response_log_probs(model, batch["input_ids"], batch["labels"], True))


def test_the_supplement_adapters_say_they_have_no_counterpart(adapters):
    with pytest.raises(NotImplementedError, match="supplement"):
        adapters.run_parse_gsm8k_response("12")
