"""Reward functions the tests name as ``tests.reward_fixtures:NAME``. Kept in a module that imports
nothing heavy: user rewards run in a supervised worker process, which imports this module."""

import time


def starts_with_7(response, ground_truth):
    r = float(response.startswith("7"))
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


def always_zero(response, ground_truth):
    return {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}


def reward_any_digit(response, ground_truth):
    r = float(any(ch.isdigit() for ch in response))
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


def hang(response, ground_truth):
    while True:
        time.sleep(0.05)
