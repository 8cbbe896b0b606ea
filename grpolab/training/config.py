"""Validated configs: YAML files plus command-line overrides; unknown keys and bad values are
one-line errors naming the key. The fields every method shares are in ``run_config.py`` and
``sampled_run_config.py``; each field is documented by the docstring under it (``--help``,
``grpolab config`` and ``docs/reference/config.md`` read them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A bad config; the message names the file or key."""


def _format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key '{key}'")
        elif not key:  # a rule across fields: its message names them
            parts.append(msg)
        else:
            parts.append(f"'{key}': {msg} (got {err.get('input')!r})")
    return f"{source}: " + "; ".join(parts)


class BaseConfig(BaseModel):
    """Base of every method's config: no unknown keys, validated on assignment, and every field
    described by the docstring under it. A field a subclass declares again only to change its
    default (``run_dir``) keeps the description of the field it replaces."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              use_attribute_docstrings=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name, field in cls.model_fields.items():
            if field.description is None:
                field.description = next((base.model_fields[name].description for base in cls.__mro__[1:]
                                          if name in getattr(base, "model_fields", {})), None)

    @classmethod
    def build(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None):
        """Load ``path`` (YAML), apply ``overrides`` (``key -> value``), validate."""
        data: dict[str, Any] = {}
        source = "config"
        if path is not None:
            source = str(path)
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"{path}: no such config file")
            try:
                loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f":{mark.line + 1}" if mark else ""
                raise ConfigError(f"{path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
            if loaded is None:
                loaded = {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: the config must be a mapping of keys to values")
            data.update(loaded)
        for key, value in (overrides or {}).items():
            key = key.replace("-", "_")
            if key not in cls.model_fields:
                raise ConfigError(f"unknown key '{key}' (command line); valid keys: {', '.join(cls.model_fields)}")
            if value is BARE_FLAG:
                if cls.model_fields[key].annotation not in (bool, bool | None):
                    raise ConfigError(f"--{key.replace('_', '-')} needs a value")
                value = True
            data[key] = value
        try:
            return cls(**data)
        except ValidationError as exc:
            raise ConfigError(_format_validation_error(exc, source)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class _BareFlag:
    """A ``--key`` given without a value: ``true`` for a boolean field, an error for any other."""

    def __repr__(self) -> str:
        return "BARE_FLAG"


BARE_FLAG = _BareFlag()


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` pairs -> dict; values parsed as YAML scalars/lists. A
    bare ``--key`` (at the end, or followed by another ``--option``) means ``true``, so every
    boolean takes ``--flag``, ``--flag true`` and ``--flag false`` alike."""
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
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        out[key.replace("-", "_")] = raw if value is None and raw not in ("null", "~", "") else value
    return out


# Fields that may change when a run is resumed besides its length (each config's ``steps_field``):
# how it is watched. Everything else is the run's own config, and changing it on resume would
# silently continue a different run.
RESUME_MAY_CHANGE = (
    "eval_every", "eval_examples", "checkpoint_every", "keep_last", "report_to", "show_progress",
    "log_generations_samples", "run_dir", "device", "token_record_groups", "threads",
)


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
            (allowed if key in may_change else refused)[key] = (old, value)
    return ResumeChanges(allowed, refused, may_change)
