"""Reward functions the tests name as ``tests.helpers.reward_fixtures:NAME``. Kept in a module that imports
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


def exit3(response, ground_truth):
    """A reward that kills its process: the scorer must charge it to the sample, not die."""
    import os

    os._exit(3)


def length_parity(response, ground_truth):
    """Varies within nearly every group (a sampled response's length is even or odd)."""
    r = float(len(response) % 2 == 0)
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


def even_answer_or_length_parity(response, ground_truth):
    """Every response to a question with an even answer scores 1 (a zero-variance group with reward > 0);
    the others score by length parity (groups that vary)."""
    r = 1.0 if int(ground_truth) % 2 == 0 else float(len(response) % 2 == 0)
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


def always_one(response, ground_truth):
    return {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}
