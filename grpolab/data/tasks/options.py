"""``task_options`` checked before a task is built, the same way for the embedded tasks and the
reasoning-gym generators: every option is one of the task's fields, of that field's type (an
integer is not a float, a bool or a string; a float is finite), within its bounds. An integer
option without an upper (lower) bound of its own is at most ``MAX_INTEGER`` (at least its
negative; a ``seed`` up to ``MAX_SEED``), so a huge one (``size: 2**63``, a 401-digit
``wrong_fraction``) is refused here rather than overflowing inside the task. A wrong one is one
line naming the task and the option (``task_options of arithmetic: digits must be an integer,
got 'two'``), never a TypeError or OverflowError from deep inside the generator."""

from __future__ import annotations

import math
import sys
import types
import typing
from typing import Any, Literal, Mapping, Union

# a field typed as one of these is checked here; any other type (lists, callables) is left to the task
SCALARS = (bool, int, float, str)
UNIONS = (Union, types.UnionType)  # Optional[int] and int | None
MAX_INTEGER = 10**9  # an integer option's bound where its field has none
MAX_SEED = 2**63 - 1  # a seed's: any 64-bit seed


def check_options(task: str, options: Mapping[str, Any], fields: Mapping[str, Any],
                  bounds: Mapping[str, tuple[float | None, float | None]] | None = None) -> None:
    """ValueError (one line, naming ``task`` and the option) unless every option is a field of
    ``fields`` (name -> type annotation), of its type and within ``bounds`` (name -> (low, high),
    inclusive; None: unbounded, but an integer's is within ``MAX_INTEGER``, a seed's ``MAX_SEED``)."""
    where = f"task_options of {task}"
    for key, value in options.items():
        if key not in fields:
            raise ValueError(f"{where}: unknown option {key!r}; its options are: {', '.join(fields)}")
        problem = type_problem(value, fields[key])
        if problem is None:
            low, high = (bounds or {}).get(key, (None, None))
            if fields[key] is int or _optional(fields[key]) is int:
                limit = MAX_SEED if key == "seed" else MAX_INTEGER
                low, high = (-limit if low is None else low), (limit if high is None else high)
            problem = bound_problem(value, low, high)
        if problem is not None:
            raise ValueError(f"{where}: {key} {problem}")


def type_problem(value: Any, annotation: Any) -> str | None:
    """What is wrong with ``value`` as a ``annotation`` (``must be an integer, got 2.5``), or None."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in UNIONS:
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        return type_problem(value, kinds[0]) if len(kinds) == 1 else None
    if origin is Literal:
        return None if value in args else f"must be one of {', '.join(map(repr, args))}, got {value!r}"
    if annotation is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"must be an integer, got {value!r}"
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {value!r}"
        if isinstance(value, int):  # exact comparison: an int too large for a float does not overflow
            return None if abs(value) <= sys.float_info.max else f"must be a finite number, got {shown(value)}"
        return None if math.isfinite(value) else f"must be a finite number, got {value!r}"
    if annotation is str:
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    return None  # lists, tuples, callables: the task's own checks


def bound_problem(value: float, low: float | None, high: float | None) -> str | None:
    """``must be at least 1, got -5`` (or at most ``high``), or None within the bounds."""
    if value is None:
        return None
    if low is not None and value < low:
        return f"must be at least {low}, got {shown(value)}"
    if high is not None and value > high:
        return f"must be at most {high}, got {shown(value)}"
    return None


def shown(value: Any) -> str:
    """``value!r``, but a huge integer as its number of digits (``an integer of 401 digits``): no
    line of hundreds of digits, and none past Python's int-to-str limit."""
    if not isinstance(value, int) or isinstance(value, bool):
        return repr(value)
    try:
        text = repr(value)
    except ValueError:  # beyond sys.get_int_max_str_digits()
        return "an integer of more digits than Python prints"
    return text if len(text) <= 30 else f"an integer of {len(text.lstrip('-'))} digits"


def _optional(annotation: Any) -> Any:
    """``X`` of ``Optional[X]``, else None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) in UNIONS and len(args) == 1 else None


def dataclass_fields(cls) -> dict[str, Any]:
    """A task dataclass's settable fields (name -> resolved type): those of a scalar type."""
    hints = typing.get_type_hints(cls)
    return {name: hints[name] for name in cls.__dataclass_fields__ if hints.get(name) in SCALARS}
