"""Evaluation: generate for held-out questions, grade, summarise; ``log_generations`` (CS336 §4.2).

The code lives in ``evaluation`` (``evaluate``), ``generations`` (entropies, sample logs),
``metrics`` (pass@k, maj@k, ...), ``mode`` (dropout off) and ``report`` (``grpolab eval``)."""

from .evaluation import EvalResult, evaluate
from .generations import log_generations, token_entropies
from .mode import eval_mode

__all__ = ["EvalResult", "eval_mode", "evaluate", "log_generations", "token_entropies"]
