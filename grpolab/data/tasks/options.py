"""``task_options`` checked before a task is built, the same way for the embedded tasks and the
reasoning-gym generators: every option is one of the task's fields, of that field's type (an
integer is not a float, a bool or a string; a float is finite), within its bounds. A wrong one is
one line naming the task and the option (``task_options of arithmetic: digits must be an integer,
got 'two'``), never a TypeError from deep inside the generator."""

from __future__ import annotations

import math
import typing
from typing import Any, Literal, Mapping, Union

# a field typed as one of these is checked here; any other type (lists, callables) is left to the task
SCALARS = (bool, int, float, str)


def check_options(task: str, options: Mapping[str, Any], fields: Mapping[str, Any],
                  bounds: Mapping[str, tuple[float | None, float | None]] | None = None) -> None:
    """ValueError (one line, naming ``task`` and the option) unless every option is a field of
    ``fields`` (name -> type annotation), of its type and within ``bounds`` (name -> (low, high),
    inclusive; None: unbounded)."""
    where = f"task_options of {task}"
    for key, value in options.items():
        if key not in fields:
            raise ValueError(f"{where}: unknown option {key!r}; its options are: {', '.join(fields)}")
        problem = type_problem(value, fields[key])
        if problem is None and bounds and key in bounds:
            problem = bound_problem(value, *bounds[key])
        if problem is not None:
            raise ValueError(f"{where}: {key} {problem}")


def type_problem(value: Any, annotation: Any) -> str | None:
    """What is wrong with ``value`` as a ``annotation`` (``must be an integer, got 2.5``), or None."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union:
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
        return None if math.isfinite(value) else f"must be a finite number, got {value!r}"
    if annotation is str:
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    return None  # lists, tuples, callables: the task's own checks


def bound_problem(value: float, low: float | None, high: float | None) -> str | None:
    """``must be at least 1, got -5`` (or at most ``high``), or None within the bounds."""
    if value is None:
        return None
    if low is not None and value < low:
        return f"must be at least {low}, got {value!r}"
    if high is not None and value > high:
        return f"must be at most {high}, got {value!r}"
    return None


def dataclass_fields(cls) -> dict[str, Any]:
    """A task dataclass's settable fields (name -> resolved type): those of a scalar type."""
    hints = typing.get_type_hints(cls)
    return {name: hints[name] for name in cls.__dataclass_fields__ if hints.get(name) in SCALARS}
