"""Validated configs: YAML files plus command-line overrides; unknown keys and bad values are
one-line errors naming the key. The fields every method shares are in ``run_config.py`` and
``sampled_run_config.py``; each field is documented by the docstring under it (``--help``,
``grpolab config`` and ``docs/reference/config.md`` read them).

A config file is read by ``load_yaml_file``: safe YAML (no Python tags), at most ``MAX_CONFIG_BYTES``,
no duplicate key, aliases that expand to at most ``MAX_ALIAS_VALUES`` values. A command-line value is
kept as typed (``CommandLineValue``) and read by its field's type when the config is built
(``field_value``): a text field (str, a path, a choice of names) takes the text verbatim, any other
field reads it as YAML."""

from __future__ import annotations

import difflib
import re
import reprlib
import types
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from .config_files import MISSING_KEY, ConfigError, load_yaml, load_yaml_file

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch
NULL_TEXTS = ("null", "~", "")  # a command-line value meaning null for a field that may be null


# ---------------------------------------------------------------- command-line values


class CommandLineValue(str):
    """A value as typed on the command line (``parse_overrides``); ``BaseConfig.build`` reads it by
    its field's type (``field_value``)."""


def _is_text_type(kind: Any) -> bool:
    if get_origin(kind) is Annotated:
        kind = get_args(kind)[0]
    if get_origin(kind) is Literal:
        return all(isinstance(v, str) for v in get_args(kind))
    return kind is str or (isinstance(kind, type) and issubclass(kind, PurePath))


def _union_members(annotation: Any) -> tuple:
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)


def yaml_value(raw: str) -> Any:
    """A command-line value read as YAML (``load_yaml``) for a field that is not text: a number, a
    boolean, a list, a mapping, null. YAML that reads as a string gives back the text as typed (so
    ``a #b`` keeps its ``#b``), and so does text that is not YAML."""
    try:
        value = load_yaml(raw)
    except (yaml.YAMLError, RecursionError):
        return raw
    if value is None and raw.strip() not in NULL_TEXTS:  # '#': a comment to YAML, a value as typed
        return raw
    return raw if isinstance(value, str) else value


INTEGER = re.compile(r"[-+]?[0-9]+")


def field_value(annotation: Any, raw: str) -> Any:
    """A command-line value for a field of type ``annotation``. A text field (str, a Path, a choice
    of names, or one of these or null) takes the text exactly as typed; null, ~ or an empty value
    is null for a field that may be null. Any other field reads it as YAML (``yaml_value``)."""
    members = _union_members(annotation)
    kinds = [k for k in members if k is not type(None)]
    if kinds and all(_is_text_type(k) for k in kinds):
        return None if len(kinds) < len(members) and raw in NULL_TEXTS else str(raw)
    if kinds == [int] and not (len(kinds) < len(members) and raw in NULL_TEXTS):
        # decimal digits only: YAML 1.1 would read 010 as 8, 1:30 as 90, 0b11 as 3 (pydantic refuses the rest)
        return int(raw) if INTEGER.fullmatch(raw.strip()) else str(raw)
    return yaml_value(raw)


# ---------------------------------------------------------------- validation messages

_SHORT = reprlib.Repr()  # a few levels and items of a container, then "..."
for _name, _limit in {"maxlevel": 2, "maxtuple": 4, "maxlist": 4, "maxarray": 4, "maxdict": 4, "maxset": 4,
                      "maxfrozenset": 4, "maxdeque": 4, "maxstring": 60, "maxlong": 40, "maxother": 60}.items():
    setattr(_SHORT, _name, _limit)
MAX_SHOWN = 100  # characters of a refused value a message shows


def short_repr(value: Any) -> str:
    """``repr(value)`` in at most ``MAX_SHOWN`` characters, without walking more than a few levels and
    items of a container (a value built from YAML aliases can be a billion items deep)."""
    text = _SHORT.repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def import_beside(path: str | Path) -> None:
    """A config's folder goes at the end of ``sys.path`` (after the installed packages, which it can
    never shadow): a ``myrewards:fn`` reward, tool or environment module beside the config imports
    without PYTHONPATH, in this process and in the reward workers (which get this ``sys.path``)."""
    import sys

    folder = str(Path(path).expanduser().resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)


def did_you_mean(key: str, names) -> str:
    """``; did you mean 'group_size'?`` for a misspelt ``key`` (difflib's closest of ``names``), or nothing."""
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.75)
    return f"; did you mean '{close[0]}'?" if close else ""


def _format_validation_error(exc: ValidationError, source: str, typed: frozenset[str] = frozenset(),
                             fields=()) -> str:
    """One line for every refused key; a key in ``typed`` came from the command line and says so
    (the line starts with ``command line`` when every refused key did)."""
    errors = exc.errors()
    cli = [bool(err["loc"]) and err["loc"][0] in typed for err in errors]
    source = source if not all(cli) else "command line"
    parts = []
    for err, from_cli in zip(errors, cli):
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        where = " (command line)" if from_cli and source != "command line" else ""
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key '{key}'{did_you_mean(key, fields)}")
        elif not key:  # a rule across fields: its message names them
            parts.append(msg)
        else:
            parts.append(f"'{key}'{where}: {msg} (got {short_repr(err.get('input'))})")
    return f"{source}: " + "; ".join(parts)


def _beyond_float32(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` (a number, or a list, tuple or mapping of them, a few levels deep) holds a float
    whose magnitude float32 cannot hold."""
    if isinstance(value, float):
        return abs(value) > FLOAT32_MAX
    if depth < 4 and isinstance(value, (list, tuple)):
        return any(_beyond_float32(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return any(_beyond_float32(v, depth + 1) for v in value.values())
    return False


class BaseConfig(BaseModel):
    """Base of every method's config: no unknown keys, validated on assignment, no NaN or infinite
    float, and every field described by the docstring under it. A field a subclass declares again
    only to change its default (``run_dir``) keeps the description of the field it replaces."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              use_attribute_docstrings=True, allow_inf_nan=False)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name, field in cls.model_fields.items():
            if field.description is None:
                field.description = next((base.model_fields[name].description for base in cls.__mro__[1:]
                                          if name in getattr(base, "model_fields", {})), None)

    @classmethod
    def build(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None):
        """Load ``path`` (YAML, ``load_yaml_file``), apply ``overrides`` (``key -> value``; a
        ``CommandLineValue`` is read by its field's type), validate."""
        data: dict[str, Any] = {}
        source = "config"
        if path is not None:
            source = str(path)
            loaded = load_yaml_file(path)
            if loaded is None:
                loaded = {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: the config must be a mapping of keys to values")
            import_beside(path)
            odd = next((k for k in loaded if not isinstance(k, str)), MISSING_KEY)
            if odd is not MISSING_KEY:
                raise ConfigError(f"{path}: key {short_repr(odd)} is not a name (every key is a field's name)")
            data.update(loaded)
        typed = set()
        for key, value in (overrides or {}).items():
            key = key.replace("-", "_")
            data[key] = cls._override(key, value)
            if isinstance(value, CommandLineValue):
                typed.add(key)
        try:
            return cls(**data)
        except ValidationError as exc:
            raise ConfigError(_format_validation_error(exc, source, frozenset(typed), cls.model_fields)) from None

    @classmethod
    def _override(cls, key: str, value: Any) -> Any:
        """An override's value for field ``key``: a bare flag is true for a boolean, a command-line
        value is read by the field's type (``field_value``), any other value is taken as it is."""
        if key not in cls.model_fields:
            hint = did_you_mean(key, cls.model_fields) or (
                f"; `grpolab config {cls.command}` lists the keys" if hasattr(cls, "command") else "")
            raise ConfigError(f"unknown key '{key}' (command line){hint}")
        annotation = cls.model_fields[key].annotation
        if value is BARE_FLAG:
            if bool not in _union_members(annotation):
                raise ConfigError(f"--{key.replace('_', '-')} needs a value")
            return True
        return field_value(annotation, value) if isinstance(value, CommandLineValue) else value

    @field_validator("*", mode="before")
    @classmethod
    def _one_as_list(cls, value: Any, info: ValidationInfo) -> Any:
        """A bare name for a list field is a list of one (``report_to: wandb``, ``--report-to wandb``)."""
        if isinstance(value, str) and info.field_name in cls.model_fields:
            kinds = _union_members(cls.model_fields[info.field_name].annotation)
            if str not in kinds and any(get_origin(k) is list for k in kinds):
                return [value]
        return value

    @field_validator("*")
    @classmethod
    def _within_float32(cls, value: Any) -> Any:
        """A float beyond float32's range (a learning rate or a reward weight of 1e39), at any depth of
        a field, is refused: every tensor it meets is float32, where it is infinite."""
        if _beyond_float32(value):
            raise ValueError(f"{short_repr(value)} holds a number beyond float32's range (±{FLOAT32_MAX:.3g})")
        return value

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class _BareFlag:
    """A ``--key`` given without a value: ``true`` for a boolean field, an error for any other."""

    def __repr__(self) -> str:
        return "BARE_FLAG"


BARE_FLAG = _BareFlag()


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` pairs -> dict of ``CommandLineValue``: each value is kept
    as typed, and read by its field's type when the config is built (``field_value``: text fields
    verbatim, other fields as YAML). A bare ``--key`` (at the end, or followed by another
    ``--option``) means ``true``, so every boolean takes ``--flag``, ``--flag true`` and ``--flag
    false`` alike."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: overrides are --key value")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        elif i + 1 >= len(args) or args[i + 1].startswith("--"):
            out[key.replace("-", "_")] = BARE_FLAG  # true for a boolean field; any other needs a value
            i += 1
            continue
        else:
            raw = args[i + 1]
            i += 2
        out[key.replace("-", "_")] = CommandLineValue(raw)
    return out


# Fields that may change when a run is resumed besides its length (each config's ``steps_field``):
# how it is watched. Everything else is the run's own config, and changing it on resume would
# silently continue a different run.
RESUME_MAY_CHANGE = (
    "eval_every", "eval_examples", "checkpoint_every", "keep_last", "report_to", "tracker_project", "tracker_entity",
    "tracker_run_name", "show_progress",
    "log_generations_samples", "run_dir", "device", "token_record_groups", "threads", "keep_freed_memory",
    "sampler_threads",  # like threads: how fast, not what (reliability case A15)
)
# Fields that may be turned off on resume: an asynchronous run's checkpoint resumed synchronously
# (``max_staleness: 0``) drops its in-flight batches and regenerates them from the position after the
# last trained one (docs/guides/async-rollouts.md; reliability case A14).
RESUME_MAY_TURN_OFF = ("max_staleness",)


@dataclass
class ResumeChanges:
    allowed: dict[str, tuple[Any, Any]]
    refused_fields: dict[str, tuple[Any, Any]]
    allowed_keys: tuple[str, ...]

    @property
    def refused(self) -> str:
        """A one-line diff of the refused changes (empty when none): ``key: old -> new; ...``."""
        return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in self.refused_fields.items())


def resume_changes(saved: dict[str, Any], new: dict[str, Any], steps_field: str) -> ResumeChanges:
    """Which fields differ between a run's saved config and the one it is resumed with; the run's
    length (``steps_field``) and the fields of ``RESUME_MAY_CHANGE`` may."""
    may_change = (steps_field, *RESUME_MAY_CHANGE)
    allowed, refused = {}, {}
    for key in sorted(saved):  # a field the saved run did not have (a newer grpolab) cannot have changed
        old, value = saved.get(key), new.get(key)
        if old != value and not (isinstance(old, (list, tuple)) and list(old) == list(value or [])):
            (allowed if key in may_change or (key in RESUME_MAY_TURN_OFF and not value) else refused)[key] = \
                (old, value)
    return ResumeChanges(allowed, refused, may_change)
