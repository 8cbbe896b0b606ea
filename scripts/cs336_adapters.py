"""The ``tests/adapters.py`` of Stanford CS336 Assignment 5 (spring 2025, stanford-cs336/assignment5-alignment),
answered by grpolab: each adapter forwards to the ``grpolab.core`` function of the same CS336 name.

Use it in a clone of the assignment whose environment also has grpolab (``pip install -e PATH/TO/grpolab``):

    cp PATH/TO/grpolab/scripts/cs336_adapters.py tests/adapters.py && uv run pytest

Every argument is passed by keyword: the official ``run_masked_normalize(tensor, mask, dim, normalize_constant)``
orders its last two parameters the other way round from ``grpolab.core.masked_normalize(tensor, mask,
normalize_constant, dim)``, and a positional forward would swap them. The adapters of the optional
supplement (instruction tuning, DPO, MMLU/GSM8K parsing) have no ``grpolab.core`` counterpart and raise
``NotImplementedError`` as the starter file does. tests/core/test_cs336_adapters.py checks each forward.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Literal

import torch

from grpolab import core


def run_tokenize_prompt_and_output(
    prompt_strs: list[str], output_strs: list[str], tokenizer
) -> dict[str, torch.Tensor]:
    return core.tokenize_prompt_and_output(prompt_strs=prompt_strs, output_strs=output_strs, tokenizer=tokenizer)


def run_compute_group_normalized_rewards(
    reward_fn: Callable,
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    return core.compute_group_normalized_rewards(
        reward_fn=reward_fn, rollout_responses=rollout_responses, repeated_ground_truths=repeated_ground_truths,
        group_size=group_size, advantage_eps=advantage_eps, normalize_by_std=normalize_by_std)


def run_compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    return core.compute_entropy(logits=logits)


def run_get_response_log_probs(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool
) -> dict[str, torch.Tensor]:
    return core.get_response_log_probs(model=model, input_ids=input_ids, labels=labels,
                                       return_token_entropy=return_token_entropy)


def run_compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    return core.compute_naive_policy_gradient_loss(raw_rewards_or_advantages=raw_rewards_or_advantages,
                                                   policy_log_probs=policy_log_probs)


def run_compute_grpo_clip_loss(
    advantages: torch.Tensor, policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return core.compute_grpo_clip_loss(advantages=advantages, policy_log_probs=policy_log_probs,
                                       old_log_probs=old_log_probs, cliprange=cliprange)


def run_compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor,
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return core.compute_policy_gradient_loss(policy_log_probs=policy_log_probs, loss_type=loss_type,
                                             raw_rewards=raw_rewards, advantages=advantages,
                                             old_log_probs=old_log_probs, cliprange=cliprange)


def run_masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return core.masked_mean(tensor=tensor, mask=mask, dim=dim)


def run_sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: int | None = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return core.sft_microbatch_train_step(policy_log_probs=policy_log_probs, response_mask=response_mask,
                                          gradient_accumulation_steps=gradient_accumulation_steps,
                                          normalize_constant=normalize_constant)


def run_grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: Literal["no_baseline", "reinforce_with_baseline", "grpo_clip"],
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return core.grpo_microbatch_train_step(policy_log_probs=policy_log_probs, response_mask=response_mask,
                                           gradient_accumulation_steps=gradient_accumulation_steps,
                                           loss_type=loss_type, raw_rewards=raw_rewards, advantages=advantages,
                                           old_log_probs=old_log_probs, cliprange=cliprange)


def run_masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None, normalize_constant: float = 1.0
) -> torch.Tensor:
    # by keyword: grpolab.core.masked_normalize takes (tensor, mask, normalize_constant, dim)
    return core.masked_normalize(tensor=tensor, mask=mask, dim=dim, normalize_constant=normalize_constant)


# The optional supplement (safety, instruction tuning, RLHF): no grpolab.core counterpart.

def _supplement(name: str):
    raise NotImplementedError(f"{name}: the optional supplement; grpolab.core has no counterpart")


def get_packed_sft_dataset(tokenizer, dataset_path: str | os.PathLike, seq_length: int, shuffle: bool):
    _supplement("get_packed_sft_dataset")


def run_iterate_batches(dataset, batch_size: int, shuffle: bool):
    _supplement("run_iterate_batches")


def run_parse_mmlu_response(mmlu_example: dict[str, Any], model_output: str) -> str | None:
    _supplement("run_parse_mmlu_response")


def run_parse_gsm8k_response(model_output: str) -> str | None:
    _supplement("run_parse_gsm8k_response")


def run_compute_per_instance_dpo_loss(lm, lm_ref, tokenizer, beta: float, prompt: str, response_chosen: str,
                                      response_rejected: str) -> torch.Tensor:
    _supplement("run_compute_per_instance_dpo_loss")
