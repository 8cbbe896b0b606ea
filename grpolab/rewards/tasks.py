"""Verifiers for the embedded tasks: exact integer arithmetic and Countdown equations.

An integer is written in plain ASCII digits with an optional sign (``-7``, ``+7``, ``\u2212 7`` as
``-7``), as ``r1_zero`` reads one: not in Python's literal spellings (``1_0``, ``0x0a``, fullwidth
or other Unicode digits). The Countdown verifier parses the model's equation with ``ast`` and
evaluates it itself, admitting only such integers, ``+ - * /`` and parentheses: model text never
reaches ``eval``/``exec``. An equation may state its value (``3*5-2 = 13``): the right-hand side
must then be the left's value, so a false claim (``3*5-2 = 99``) is wrong whatever the left reaches.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from .verifiers import extract_r1_zero_answer, reward_dict

MAX_EQUATION_CHARS = 200
_INTEGER_RE = re.compile(r"[+-]?[0-9]+")
_EQUATION_CHARS_RE = re.compile(r"[0-9+\-*/()\s]*")  # what an admitted equation is written with


def plain_integer(text: str) -> int | None:
    """``text`` (surrounding whitespace and a Unicode minus allowed) as an integer written in ASCII
    digits with an optional sign, else None: ``1_0``, ``0x0a``, ``１０``, ``10.0`` are not; nor is one
    of more digits (leading zeros aside) than Python reads (``sys.get_int_max_str_digits()``: 4300),
    longer than any task's answer, so a model's 5000-digit answer is wrong, not a verifier error."""
    text = text.strip().replace("\u2212", "-")
    if not _INTEGER_RE.fullmatch(text):
        return None
    sign, digits = ("-" if text[0] == "-" else ""), text.lstrip("+-").lstrip("0") or "0"
    try:
        return int(sign + digits)
    except ValueError:  # past the int-from-str limit
        return None


def arithmetic_reward_fn(response: str, ground_truth: Any, *, lenient_format: bool = False) -> dict[str, float]:
    """R1-Zero format, and the answer block is exactly the integer ``ground_truth``."""
    answer = extract_r1_zero_answer(response, lenient_format)
    if answer is None:
        return reward_dict(False, False)
    value = plain_integer(answer)
    return reward_dict(True, value is not None and value == plain_integer(str(ground_truth)))


class _Rejected(ValueError):
    pass


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        # "-3" as a literal is not one of the given numbers; reject unary minus
        raise _Rejected("unary minus")
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise _Rejected("division by zero")
        return left / right
    raise _Rejected(f"not allowed: {type(node).__name__}")


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]] | None:
    """Value of an integer ``+ - * /`` equation and the numbers it uses, or None when not admitted:
    written with other characters (Python's literal spellings), or stating a value (``= N``) that
    is not the left side's."""
    expr = equation.replace("×", "*").replace("÷", "/").replace("\u2212", "-").strip()
    expr, equals, stated = expr.partition("=")
    if not expr.strip() or len(expr) > MAX_EQUATION_CHARS or "**" in expr or "//" in expr:
        return None
    if not _EQUATION_CHARS_RE.fullmatch(expr):
        return None
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        used: list[int] = []
        value = _evaluate(tree, used)
    except (SyntaxError, _Rejected, RecursionError, ValueError):
        return None
    if equals and plain_integer(stated) != value:  # "3*5-2 = 13": the right side must be the value
        return None
    return value, used


def countdown_reward_fn(response: str, ground_truth: Any, *, lenient_format: bool = False) -> dict[str, float]:
    """Countdown (TinyZero): the answer block is an equation that uses each given number at most
    once and evaluates to the target. ``ground_truth`` is ``{"numbers": [...], "target": int}``."""
    answer = extract_r1_zero_answer(response, lenient_format)
    if answer is None:
        return reward_dict(False, False)
    result = evaluate_equation(answer)
    if result is None:
        return reward_dict(True, False)
    value, used = result
    available = Counter(int(n) for n in ground_truth["numbers"])
    ok = value == int(ground_truth["target"]) and not (Counter(used) - available)
    return reward_dict(True, ok)
