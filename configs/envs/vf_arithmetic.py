"""A verifiers environment written against verifiers' classic API (``load_environment``,
``SingleTurnEnv``, ``Rubric``): two-digit addition asked in words, for a chat model.

    env: {verifiers: configs/envs/vf_arithmetic.py, args: {n: 2000, eval_n: 200}}

The rubric is one function: 1.0 when the last number of the reply is the sum. Train and eval
questions are drawn from one seeded stream without repeats, so the eval set is held out.
"""

import random
import re

import datasets
import verifiers as vf

SYSTEM_PROMPT = "You are a calculator. Reply with only the result. Example: What is 12 + 30? 42"


def correct_answer(completion, answer) -> float:
    """1.0 when the reply's last number is the answer."""
    text = str(completion[-1]["content"] or "") if completion else ""
    numbers = re.findall(r"-?\d+", text)
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def _questions(n: int, seed: int) -> list[dict]:
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def load_environment(n: int = 2000, eval_n: int = 200, seed: int = 0) -> vf.Environment:
    rows = _questions(n + eval_n, seed)
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows[:n]),
                            eval_dataset=datasets.Dataset.from_list(rows[n:]), system_prompt=SYSTEM_PROMPT,
                            rubric=vf.Rubric(funcs=[correct_answer], weights=[1.0]))
