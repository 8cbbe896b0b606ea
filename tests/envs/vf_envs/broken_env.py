"""verifiers environments that go wrong, one per ``load_environment(kind=...)``: its load raises,
it returns no environment, it calls ``sys.exit``/``os._exit`` or never returns, a rubric function
hangs, one returns NaN, one raises, one returns a string, one scores a group."""

import asyncio
import math
import os
import sys
import time

import datasets
import verifiers as vf


def _dataset() -> datasets.Dataset:
    return datasets.Dataset.from_list([{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)])


def fine(completion, answer) -> float:
    return 1.0 if answer in str(completion[-1]["content"]) else 0.0


async def hangs(completion) -> float:
    await asyncio.sleep(600)
    return 1.0


def not_a_number(completion) -> float:
    return math.nan


def raises(completion) -> float:
    raise RuntimeError("the rubric broke")


def says_high(completion) -> str:
    return "high"


def group_reward(completions, answers) -> list[float]:
    return [0.0 for _ in completions]


def tool_add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def load_environment(kind: str = "hang") -> vf.Environment:
    if kind == "raise":
        raise RuntimeError("the dataset is gone\nand this second line is not shown")
    if kind == "exit0":
        sys.exit(0)
    if kind == "osexit":
        os._exit(0)
    if kind == "sleep":
        time.sleep(3600)
    if kind == "not_env":
        return {"dataset": _dataset()}
    if kind == "tool":
        return vf.ToolEnv(dataset=_dataset(), tools=[tool_add], rubric=vf.Rubric(funcs=[fine]))
    funcs = {"hang": [fine, hangs], "nan": [fine, not_a_number], "group": [fine, group_reward],
             "raises": [fine, raises], "string": [fine, says_high]}[kind]
    return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=funcs))
