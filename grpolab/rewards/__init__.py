"""Verifiers and reward plumbing. Every reward is ``fn(response, ground_truth) -> dict`` with
``reward``, ``format_reward`` and ``answer_reward`` floats."""

from .math_grader import is_equivalent, normalize_answer, parse_number
from .registry import (
    BUILTIN_REWARDS,
    RewardComponent,
    RewardScorer,
    WeightedReward,
    build_reward,
    get_reward_fn,
)
from .tasks import arithmetic_reward_fn, countdown_reward_fn, evaluate_equation
from .verifiers import (
    extract_r1_zero_answer,
    grade_answer,
    gsm8k_reward_fn,
    last_boxed,
    last_number,
    question_only_reward_fn,
    r1_zero_reward_fn,
)

__all__ = [
    "BUILTIN_REWARDS",
    "RewardComponent",
    "RewardScorer",
    "WeightedReward",
    "arithmetic_reward_fn",
    "build_reward",
    "countdown_reward_fn",
    "evaluate_equation",
    "extract_r1_zero_answer",
    "get_reward_fn",
    "grade_answer",
    "gsm8k_reward_fn",
    "is_equivalent",
    "last_boxed",
    "last_number",
    "normalize_answer",
    "parse_number",
    "question_only_reward_fn",
    "r1_zero_reward_fn",
]
