"""A single-turn verifiers environment: "What is a + b?" with a sync and an async reward function.

``correct_answer`` (weight 1.0): the completion's last number is the sum; ``short_answer`` (async,
weight 0.1): the completion is at most 8 characters. So "7" scores 1.1, "8" 0.1, "the answer is 7" 1.0.
"""

import re

import datasets
import verifiers as vf

SYSTEM_PROMPT = "Answer with the number only."


def _text(completion) -> str:
    return str(completion[-1]["content"] or "") if completion else ""


def correct_answer(completion, answer) -> float:
    numbers = re.findall(r"-?\d+", _text(completion))
    return 1.0 if numbers and numbers[-1] == answer else 0.0


async def short_answer(completion) -> float:
    return 1.0 if len(_text(completion)) <= 8 else 0.0


def rows(n: int) -> list[dict]:
    return [{"question": f"What is {i % 9} + {i // 9}?", "answer": str(i % 9 + i // 9)} for i in range(n)]


def load_environment(n: int = 64, eval_n: int = 0, **kw) -> vf.Environment:
    """``n`` training questions; ``eval_n`` > 0: an eval_dataset of that many more."""
    evals = datasets.Dataset.from_list(rows(n + eval_n)[n:]) if eval_n else None
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows(n)), eval_dataset=evals,
                            system_prompt=SYSTEM_PROMPT,
                            rubric=vf.Rubric(funcs=[correct_answer, short_answer], weights=[1.0, 0.1]), **kw)
