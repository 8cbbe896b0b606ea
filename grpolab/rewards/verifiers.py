"""Verifiers: ``fn(response, ground_truth) -> {"reward", "format_reward", "answer_reward"}``.

``ground_truth`` may be a string, a number, or a list of acceptable answers (any one matches).
"""

from __future__ import annotations

import re
from typing import Any

from .math_grader import DEFAULT_TIMEOUT_S, is_equivalent, normalize_answer

_LENIENT_RE = re.compile(r"</think>\s*<answer>(.*?)</answer>", re.DOTALL)


def _score(format_ok: bool, answer_ok: bool) -> dict[str, float]:
    return {
        "reward": float(format_ok and answer_ok),
        "format_reward": float(format_ok),
        "answer_reward": float(answer_ok),
    }


def _gold_list(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, (list, tuple)):
        return [str(g) for g in ground_truth]
    return [str(ground_truth)]


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces handled."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        # "\boxed 5" form
        rest = text[start:].split(None, 1)
        return rest[1].split("$")[0].strip() if len(rest) > 1 else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def grade_answer(answer: str | None, ground_truth: Any, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when ``answer`` matches any acceptable ground truth (``\\boxed{}`` content preferred)."""
    if answer is None:
        return False
    boxed = last_boxed(answer)
    candidate = boxed if boxed is not None else answer
    return any(is_equivalent(candidate, gold, timeout) for gold in _gold_list(ground_truth))


def extract_r1_zero_answer(response: str, lenient_format: bool = False) -> str | None:
    """The answer block's content when the response has the R1-Zero format, else None.

    Strict (CS336's grader): the response contains ``</think> <answer>`` (one space) and a
    ``</answer>`` after it. Lenient: any whitespace between the tags.
    """
    if lenient_format:
        m = _LENIENT_RE.search(response)
        return m.group(1) if m else None
    start = response.find("</think> <answer>")
    if start < 0:
        return None
    body_start = start + len("</think> <answer>")
    end = response.find("</answer>", body_start)
    if end < 0:
        return None
    return response[body_start:end]


def r1_zero_reward_fn(
    response: str,
    ground_truth: Any,
    fast: bool = True,
    *,
    lenient_format: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> dict[str, float]:
    """R1-Zero reward (CS336 A5 ``r1_zero_reward_fn``): 1 only when the format and the answer are right.

    ``response`` is what follows the prompt's ``<think>``. A badly formatted response scores 0 on
    all three keys, as in CS336's grader; text after ``</answer>`` (an end-of-turn token) is ignored.
    ``fast`` is accepted for compatibility with the CS336 grader's signature; grading is always the
    fast exact path first, then math-verify.
    """
    answer = extract_r1_zero_answer(response, lenient_format)
    if answer is None:
        return _score(False, False)
    return _score(True, grade_answer(answer.strip(), ground_truth, timeout))


_LAST_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators allowed), or None."""
    matches = _LAST_NUMBER_RE.findall(text)
    return matches[-1].rstrip(",") if matches else None


def question_only_reward_fn(response: str, ground_truth: Any, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, float]:
    """No format requirement: the answer is the last ``\\boxed{}``, else the last number."""
    boxed = last_boxed(response)
    answer = boxed if boxed is not None else last_number(response)
    ok = answer is not None and any(is_equivalent(answer, gold, timeout) for gold in _gold_list(ground_truth))
    return _score(True, ok)


def gsm8k_reward_fn(response: str, ground_truth: Any, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, float]:
    """GSM8K: the R1-Zero answer block when present, else ``#### N``, else the last number.

    The format reward is 1 when an answer could be located at all.
    """
    answer = extract_r1_zero_answer(response, lenient_format=True)
    if answer is None and "####" in response:
        answer = response.rsplit("####", 1)[1].strip().split("\n")[0]
    if answer is None:
        answer = last_boxed(response) or last_number(response)
    if answer is None:
        return _score(False, False)
    boxed = last_boxed(answer)
    if boxed is None:
        number = last_number(normalize_answer(answer))
        answer = number if number is not None else answer
    else:
        answer = boxed
    return _score(True, any(is_equivalent(answer, gold, timeout) for gold in _gold_list(ground_truth)))
