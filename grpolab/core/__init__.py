"""grpolab.core: the tensor math of SFT, GRPO, PPO and DPO. Imports nothing but torch.

This file only re-exports. Policy losses, advantage estimators and divergences are registered by
name in ``registry.py`` (config validators use ``policy_loss_names()`` / ``advantage_estimator_names()``
/ ``divergence_names()``): the CS336 losses in ``losses.py``, GSPO / CISPO / SAPO in
``ratio_losses.py``, the estimators in ``advantages.py``, the student/teacher divergences of
distillation in ``divergences.py``. ``importance.py`` holds the sampler/trainer IS correction,
``shaping.py`` DAPO's overlong reward penalty.

Names, parameters and semantics follow Stanford CS336 Assignment 5 where it defines them.
"""

from .advantages import (
    SCALE_REWARDS,
    compute_advantages,
    compute_gae,
    compute_group_normalized_rewards,
    grpo_advantages,
    normalize_group_rewards,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from .divergences import forward_kl, generalized_jsd, reverse_kl
from .importance import IS_LEVELS, IS_MODES, importance_sampling_weights
from .kl import (
    KL_ESTIMATORS,
    KL_LOSS_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    check_kl_loss_estimator,
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
    pack_rows,
    pad_token_id,
    tokenize_prompt_and_output,
)
from .losses import (
    LOSS_TYPES,
    compute_bradley_terry_loss,
    compute_dpo_loss,
    compute_grpo_clip_loss,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    compute_value_loss,
    entropy_bonus_loss,
)
from .masking import masked_mean, masked_normalize, whiten
from .ratio_losses import compute_cispo_loss, compute_gspo_loss, compute_sapo_loss
from .registry import (
    ADVANTAGE_ESTIMATORS,
    DIVERGENCES,
    POLICY_LOSSES,
    AdvantageEstimator,
    Divergence,
    PolicyLoss,
    advantage_estimator_names,
    divergence_names,
    get_advantage_estimator,
    get_divergence,
    get_policy_loss,
    policy_loss_names,
    register_advantage_estimator,
    register_divergence,
    register_policy_loss,
    unregister_advantage_estimator,
    unregister_divergence,
    unregister_policy_loss,
)
from .shaping import overlong_reward_penalty
from .train_steps import (
    LENGTH_NORMALIZATIONS,
    aggregate_token_loss,
    grpo_microbatch_train_step,
    sft_microbatch_train_step,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "DIVERGENCES",
    "Divergence",
    "FixedKLController",
    "IS_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "KL_LOSS_ESTIMATORS",
    "LENGTH_NORMALIZATIONS",
    "LOSS_TYPES",
    "POLICY_LOSSES",
    "PolicyLoss",
    "SCALE_REWARDS",
    "advantage_estimator_names",
    "aggregate_token_loss",
    "build_sequences",
    "check_kl_loss_estimator",
    "compute_advantages",
    "compute_cispo_loss",
    "compute_bradley_terry_loss",
    "compute_dpo_loss",
    "compute_entropy",
    "compute_gae",
    "compute_group_normalized_rewards",
    "compute_grpo_clip_loss",
    "compute_gspo_loss",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "compute_sapo_loss",
    "compute_value_loss",
    "divergence_names",
    "entropy_bonus_loss",
    "forward_kl",
    "generalized_jsd",
    "get_advantage_estimator",
    "get_divergence",
    "get_policy_loss",
    "get_response_log_probs",
    "grpo_advantages",
    "grpo_microbatch_train_step",
    "importance_sampling_weights",
    "kl_estimator",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "log_probs_from_logits",
    "masked_mean",
    "masked_normalize",
    "normalize_group_rewards",
    "overlong_reward_penalty",
    "pack_rows",
    "pad_token_id",
    "policy_loss_names",
    "register_advantage_estimator",
    "register_divergence",
    "register_policy_loss",
    "reinforce_plus_plus_advantages",
    "reverse_kl",
    "rloo_advantages",
    "sft_microbatch_train_step",
    "tokenize_prompt_and_output",
    "unregister_advantage_estimator",
    "unregister_divergence",
    "unregister_policy_loss",
    "whiten",
]
