"""The calculator tool: arithmetic on an expression parsed with ``ast``, never ``eval``.

Admitted: int and float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses. Names,
calls, attributes, subscripts, comparisons and everything else are refused. Limits keep every call
fast whatever the model writes: the expression's length and node count, the size of every literal
and intermediate value, and the exponent of ``**`` (checked before the power is computed), so
``9**9**9`` is an error in microseconds rather than a computation that never ends.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from .base import ToolOutput

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot compute; the message is the observation."""


@dataclass
class Calculator:
    """``<calculate>3*(4+5)</calculate>`` -> ``<result>27</result>``."""

    name: str = "calculate"
    max_chars: int = 200
    max_nodes: int = 100
    max_abs_value: float = 1e15
    max_exponent: int = 64

    def run(self, queries: Sequence[str]) -> list[ToolOutput]:
        out = []
        for q in queries:
            try:
                out.append(ToolOutput(format_number(self.evaluate(q))))
            except CalculatorError as exc:
                out.append(ToolOutput("", str(exc)))
        return out

    def evaluate(self, expression: str) -> int | float:
        """The value of ``expression``; ``CalculatorError`` for anything outside the whitelist or limits."""
        expr = expression.strip().replace("×", "*").replace("÷", "/").replace("\u2212", "-").replace("^", "**")
        if not expr:
            raise CalculatorError("empty expression")
        if len(expr) > self.max_chars:
            raise CalculatorError(f"expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expr, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise CalculatorError(f"cannot parse {expr!r}") from None
        if sum(1 for _ in ast.walk(tree)) > self.max_nodes:
            raise CalculatorError(f"expression has more than {self.max_nodes} parts")
        return self._eval(tree.body)

    def _check(self, value: float) -> int | float:
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result is not a finite number")
        if abs(value) > self.max_abs_value:
            raise CalculatorError(f"number larger than {self.max_abs_value:g}")
        return value

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._check(_UNARY[type(node.op)](self._eval(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise CalculatorError("division by zero")
            try:
                return self._check(_BINARY[type(node.op)](left, right))
            except (OverflowError, ZeroDivisionError, ValueError) as exc:
                raise CalculatorError(f"{type(exc).__name__}: {exc}") from None
        raise CalculatorError(f"not allowed: {type(node).__name__}")

    def _check_power(self, base: float, exponent: float) -> None:
        """Refuse a power before computing it: the exponent is bounded, and so is the result's size
        (|base|^exponent estimated with logarithms, so a huge power is never materialised)."""
        if abs(exponent) > self.max_exponent:
            raise CalculatorError(f"exponent {exponent:g} larger than {self.max_exponent}")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        if isinstance(exponent, float) and base < 0 and not exponent.is_integer():
            raise CalculatorError("fractional power of a negative number")
        if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(self.max_abs_value):
            raise CalculatorError(f"number larger than {self.max_abs_value:g}")


def format_number(value: float) -> str:
    """``27``, ``3.5``, ``0.3333333333``: integers exactly, floats to 10 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)
