"""Verifiers for the embedded tasks: exact integer arithmetic and Countdown equations.

The Countdown verifier parses the model's equation with ``ast`` and evaluates it itself, admitting
only integer literals, ``+ - * /`` and parentheses: model text never reaches ``eval``/``exec``.
"""

from __future__ import annotations

import ast
from collections import Counter
from fractions import Fraction
from typing import Any

from .verifiers import extract_r1_zero_answer, reward_dict

MAX_EQUATION_CHARS = 200


def arithmetic_reward_fn(response: str, ground_truth: Any, *, lenient_format: bool = False) -> dict[str, float]:
    """R1-Zero format, and the answer block is exactly the integer ``ground_truth``."""
    answer = extract_r1_zero_answer(response, lenient_format)
    if answer is None:
        return reward_dict(False, False)
    text = answer.strip().replace("\u2212", "-")
    try:
        ok = int(text) == int(str(ground_truth).strip())
    except ValueError:
        ok = False
    return reward_dict(True, ok)


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
    """Value of an integer ``+ - * /`` equation and the numbers it uses, or None when not admitted."""
    expr = equation.replace("×", "*").replace("÷", "/").replace("\u2212", "-").strip()
    if "=" in expr:  # "3*5-2 = 13": the left side is the equation
        expr = expr.split("=", 1)[0].strip()
    if not expr or len(expr) > MAX_EQUATION_CHARS or "**" in expr or "//" in expr:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        used: list[int] = []
        return _evaluate(tree, used), used
    except (SyntaxError, _Rejected, RecursionError, ValueError):
        return None


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
