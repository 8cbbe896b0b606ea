"""grpolab.core: the tensor math of SFT, GRPO, PPO and DPO. Imports nothing but torch.

Names, parameters and semantics follow Stanford CS336 Assignment 5 where it defines them.
"""

from .advantages import (
    compute_gae,
    compute_group_normalized_rewards,
    normalize_group_rewards,
)
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
)
from .logprobs import (
    build_sequences,
    compute_entropy,
    get_response_log_probs,
    log_probs_from_logits,
    pad_token_id,
    sum_response_log_probs,
    tokenize_prompt_and_output,
)
from .losses import (
    LOSS_TYPES,
    compute_dpo_loss,
    compute_grpo_clip_loss,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    compute_value_loss,
)
from .masking import masked_mean, masked_normalize, whiten
from .train_steps import (
    LENGTH_NORMALIZATIONS,
    aggregate_token_loss,
    grpo_microbatch_train_step,
    sft_microbatch_train_step,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KL_ESTIMATORS",
    "LENGTH_NORMALIZATIONS",
    "LOSS_TYPES",
    "aggregate_token_loss",
    "build_sequences",
    "compute_dpo_loss",
    "compute_entropy",
    "compute_gae",
    "compute_group_normalized_rewards",
    "compute_grpo_clip_loss",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "compute_value_loss",
    "get_response_log_probs",
    "grpo_microbatch_train_step",
    "kl_estimator",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "log_probs_from_logits",
    "masked_mean",
    "masked_normalize",
    "normalize_group_rewards",
    "pad_token_id",
    "sft_microbatch_train_step",
    "sum_response_log_probs",
    "tokenize_prompt_and_output",
    "whiten",
]
