"""Verifiers: ``fn(response, ground_truth) -> {"reward", "format_reward", "answer_reward"}``.

``ground_truth`` may be a string, a number, or a list of acceptable answers (any one matches).
The answer of an R1-Zero response is its LAST ``<answer>...</answer>`` block, as in CS336's grader
(a model that revises its answer is graded on the revision). An answer block with a hedge word the
reference lacks ("5 or 6", "not 5") gets no credit even when a ``\\boxed{}`` holds the right value.
"""

from __future__ import annotations

import re
from typing import Any

from .math_grader import DEFAULT_TIMEOUT_S, is_equivalent
from .normalize import hedge_words, is_unit_word, normalize_answer, parse_number

_LENIENT_RE = re.compile(r"</think>\s*<answer>")
_STRICT_MARK = "</think> <answer>"
_PLAIN_WORD_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_SCALE_TAIL_RE = re.compile(r"^\s*(hundred|thousand|million|billion|trillion)\b", re.I)
# a formula continues the number: "2\\pi", "2 \\times 10^3", "2^3", "2/3", "2 pi"
_NUMBER_CONTINUES_RE = re.compile(r"^\s*(?:\\(?:pi|times|cdot|sqrt|frac)(?![A-Za-z])|\^|/|\*|pi\b)")
_ADJACENT_WORD_RE = re.compile(r"^([A-Za-z]+)")


def reward_dict(format_ok: bool, answer_ok: bool) -> dict[str, float]:
    """The three-key reward of every built-in verifier: ``reward`` needs both format and answer."""
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
    """True when ``answer`` matches any acceptable ground truth (``\\boxed{}`` content preferred).

    Hedges are judged on the whole answer, boxes included: "\\boxed{5} or \\boxed{6}" is no answer."""
    if answer is None:
        return False
    boxed = last_boxed(answer)
    candidate = boxed if boxed is not None else answer
    golds = _gold_list(ground_truth)
    hedges = hedge_words(answer)
    return any(not (hedges - hedge_words(gold)) and is_equivalent(candidate, gold, timeout) for gold in golds)


def extract_r1_zero_answer(response: str, lenient_format: bool = False) -> str | None:
    """The content of the LAST answer block when the response has the R1-Zero format, else None.

    Format (CS336's grader): the response contains ``</think> <answer>`` (strict: one space;
    lenient: any whitespace) and every answer block from there on is closed. The answer is the text
    between the last ``<answer>`` and the ``</answer>`` after it, as CS336 takes
    ``response.split("<answer>")[-1]``; unlike CS336, text after that ``</answer>`` (an end-of-turn
    token, "and then 7") is not part of the answer, and a last block left open (a truncated
    revision) is a format failure rather than a guess at an unfinished answer.
    """
    if lenient_format:
        m = _LENIENT_RE.search(response)
        start = m.start() if m else -1
    else:
        start = response.find(_STRICT_MARK)
    if start < 0:
        return None
    body_start = response.rfind("<answer>") + len("<answer>")
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
        return reward_dict(False, False)
    return reward_dict(True, grade_answer(answer.strip(), ground_truth, timeout))


_LAST_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators allowed), or None."""
    matches = _LAST_NUMBER_RE.findall(text)
    return matches[-1].rstrip(",") if matches else None


def stated_answer(response: str) -> str | None:
    """The answer a reply states without tags: its last ``\\boxed{}``, else its last number (read with
    its scale word, "3 million"; none when a formula continues it, "2\\pi", "2x")."""
    boxed = last_boxed(response)
    return boxed if boxed is not None else stated_number(response)


def question_only_reward_fn(
    response: str, ground_truth: Any, *, timeout: float = DEFAULT_TIMEOUT_S
) -> dict[str, float]:
    """No format requirement: the answer is ``stated_answer(response)``."""
    answer = stated_answer(response)
    ok = answer is not None and any(is_equivalent(answer, gold, timeout) for gold in _gold_list(ground_truth))
    return reward_dict(True, ok)


def gsm8k_reward_fn(response: str, ground_truth: Any, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, float]:
    """GSM8K: the R1-Zero answer block when present, else ``#### N``, else the last number.

    The format reward is 1 when an answer could be located at all.
    """
    answer = extract_r1_zero_answer(response, lenient_format=True)
    if answer is None and "####" in response:
        answer = response.rsplit("####", 1)[1].strip().split("\n")[0]
    if answer is None:
        answer = last_boxed(response) or stated_number(response)
    if answer is None:
        return reward_dict(False, False)
    golds = _gold_list(ground_truth)
    if hedge_words(answer) - set().union(*(hedge_words(g) for g in golds)):
        return reward_dict(True, False)
    boxed = last_boxed(answer)
    if boxed is None:
        answer = _gsm8k_number(answer)
        if answer is None:
            return reward_dict(True, False)
    else:
        answer = boxed
    return reward_dict(True, any(is_equivalent(answer, gold, timeout) for gold in golds))


def _gsm8k_number(answer: str) -> str | None:
    """The number a GSM8K answer states: the whole answer when it is one number or a formula
    without words, else its last number ("She has 18 apples" -> 18, see ``stated_number``)."""
    norm = normalize_answer(answer)
    if parse_number(norm) is not None or not _PLAIN_WORD_RE.search(norm):
        return norm  # one number, or a formula without words ("\\frac{1}{2}"): grade it whole
    return stated_number(norm)


def stated_number(text: str) -> str | None:
    """The last number of free text as the text states it: with its scale word ("3 million"), and
    None when what follows changes its value ("2\\pi", "2^3", "2x") — reading 2 there would
    reward a wrong answer. Thousands separators are allowed."""
    matches = list(_LAST_NUMBER_RE.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    number, tail = last.group(0).rstrip(","), text[last.end():]
    scale = _SCALE_TAIL_RE.match(tail)
    if scale:
        return f"{number.replace(',', '')} {scale.group(1).lower()}"
    if _NUMBER_CONTINUES_RE.match(tail):
        return None
    word = _ADJACENT_WORD_RE.match(tail)  # "2x" is a product; "18kg" is 18 kilograms
    if word and not is_unit_word(word.group(1)):
        return None
    return number
