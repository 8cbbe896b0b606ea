"""Verifiers and reward plumbing. Every reward is ``fn(response, ground_truth) -> dict`` with
``reward``, ``format_reward`` and ``answer_reward`` floats; ``RewardScorer`` runs one safely."""

from .math_grader import MathVerifyWorker, is_equivalent, parse_matrix, shutdown_math_verify
from .normalize import HEDGE_WORDS, UNIT_WORDS, hedge_words, is_unit_word, normalize_answer, parse_number
from .registry import (
    BUILTIN_REWARDS,
    RewardComponent,
    WeightedReward,
    build_reward,
    check_reward_output,
    check_reward_spec,
    get_reward_fn,
    has_reward_model,
    is_builtin_reward,
    lenient_reward,
    reward_reads_tags,
    reward_spec,
)
from .reward_model import ModelReward, RewardModel, RewardModelOptions, reward_model_text
from .scoring import ZERO_SCORE, RewardScorer
from .supervisor import shutdown_idle_workers
from .tasks import arithmetic_reward_fn, countdown_reward_fn, evaluate_equation
from .verifiers import (
    extract_r1_zero_answer,
    grade_answer,
    gsm8k_reward_fn,
    last_boxed,
    last_number,
    question_only_reward_fn,
    r1_zero_reward_fn,
    reward_dict,
    stated_number,
)

__all__ = [
    "BUILTIN_REWARDS",
    "HEDGE_WORDS",
    "MathVerifyWorker",
    "RewardComponent",
    "RewardScorer",
    "UNIT_WORDS",
    "WeightedReward",
    "ZERO_SCORE",
    "arithmetic_reward_fn",
    "build_reward",
    "check_reward_spec",
    "check_reward_output",
    "countdown_reward_fn",
    "evaluate_equation",
    "extract_r1_zero_answer",
    "get_reward_fn",
    "has_reward_model",
    "ModelReward",
    "RewardModel",
    "RewardModelOptions",
    "reward_model_text",
    "grade_answer",
    "gsm8k_reward_fn",
    "hedge_words",
    "is_builtin_reward",
    "is_equivalent",
    "is_unit_word",
    "lenient_reward",
    "reward_reads_tags",
    "last_boxed",
    "last_number",
    "normalize_answer",
    "parse_matrix",
    "parse_number",
    "question_only_reward_fn",
    "r1_zero_reward_fn",
    "reward_dict",
    "reward_spec",
    "shutdown_idle_workers",
    "shutdown_math_verify",
    "stated_number",
]
