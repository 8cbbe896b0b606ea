"""The config fields of the training commands, described for a reader: each field's name, type,
default and description (the docstring under it where it is declared), in the sections its class
marks with ``# --- title`` comments. The one source of ``grpolab <command> --help``, ``grpolab
config <command>`` and ``docs/reference/config.md``. Likewise the options of ``grpolab eval``,
``compare`` and ``demo`` (``options.py``): each option's flag, default and description, which their
typer options take (``typer_options``).

``--help`` must stay quick and the method modules (and ``options.py``) import torch, so the help
reads ``fields.json``, a snapshot that ``python -m grpolab.cli.reference`` writes. Each class there
carries a hash of its source: a class edited since is described from the class itself (slower,
never stale), and ``tests/cli/test_reference.py`` fails until the snapshot is written again."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import re
import textwrap
import types
import typing
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import typer

from ..algorithms import METHODS

PACKAGE = Path(__file__).resolve().parents[1]  # grpolab/
SNAPSHOT = Path(__file__).with_name("fields.json")
SECTION = re.compile(r"^\s*# --- (.+?)\s*$")


@dataclass(frozen=True)
class FieldDoc:
    """One config field as ``--help`` and the reference show it."""

    name: str
    type: str
    default: str
    description: str
    section: str

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


# ---------------------------------------------------------------- from the classes


def type_text(annotation: Any, metadata: list | tuple = ()) -> str:
    """A field's type as a YAML writer reads it (``int (>= 1)``, ``constant | cosine``, ``float | null``)."""
    bounds = [f"{op} {getattr(m, attr)}" for m in metadata
              for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if hasattr(m, attr)]
    return _type_name(annotation) + (f" ({', '.join(bounds)})" if bounds else "")


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if tp is dict or origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def default_text(value: Any) -> str:
    """A default as YAML writes it: ``null``, ``true``, ``runs/grpo``, ``[0.9, 0.95]``, ``1e-05``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(default_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {default_text(v)}" for k, v in value.items()) + "}"
    return repr(value)


def config_classes(config_cls: type) -> list[type]:
    """The classes that declare ``config_cls``'s fields, base first (``RunConfig``, ..., the method's)."""
    return [c for c in reversed(config_cls.__mro__)
            if any(n in getattr(c, "model_fields", {}) for n in c.__dict__.get("__annotations__", {}))]


@functools.lru_cache(maxsize=16)
def _class_sources(path: Path) -> dict[str, str]:
    """The source text of each top-level class of ``path`` (one parse per file and process)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    return {n.name: ast.get_source_segment(text, n) for n in ast.parse(text).body if isinstance(n, ast.ClassDef)}


def source_hash(path: Path, classes: list[str]) -> str | None:
    """A hash of the source of ``classes`` in ``path`` (None: a class or the file is missing): what a
    snapshot entry was made from, so an entry whose classes were edited since is not used."""
    sources = [_class_sources(path).get(name) for name in classes]
    return None if None in sources else hashlib.sha256("\n".join(sources).encode("utf-8")).hexdigest()[:16]


def _current(entry: dict) -> bool:
    """Whether a snapshot entry's classes are unchanged since it was written."""
    return entry.get("hash") is not None and source_hash(PACKAGE / entry["source"], entry["classes"]) == entry["hash"]


def class_entry(cls: type) -> dict:
    """A config class's own fields (those its body declares), in the sections of its ``# ---``
    comments, with its ``method_defaults`` and the path and hash of its source: the snapshot's unit."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines, body = source.splitlines(), ast.parse(source).body[0].body
    markers = [(i + 1, m.group(1)) for i, line in enumerate(lines) if (m := SECTION.match(line))]
    rows = []
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in cls.model_fields:
            name, field = node.target.id, cls.model_fields[node.target.id]
            section = next((title for line, title in reversed(markers) if line < node.lineno), "")
            rows.append(asdict(FieldDoc(name, type_text(field.annotation, field.metadata),
                                        default_text(field.get_default(call_default_factory=True)),
                                        " ".join((field.description or "").split()), section)))
    path = Path(inspect.getsourcefile(cls)).resolve()
    return {"source": path.relative_to(PACKAGE).as_posix(), "classes": [cls.__name__],
            "hash": source_hash(path, [cls.__name__]), "fields": rows,
            "defaults": {k: default_text(v) for k, v in vars(cls).get("method_defaults", {}).items()}}


def assemble(entries: list[dict]) -> list[FieldDoc]:
    """The fields of a config from its classes' entries, base first: a field declared again keeps
    its place, its section and (without its own) its description; ``method_defaults`` apply."""
    rows: dict[str, FieldDoc] = {}
    for entry in entries:
        for row in entry["fields"]:
            doc = FieldDoc(**row)
            if doc.name in rows:
                old = rows[doc.name]
                doc = replace(doc, section=old.section, description=doc.description or old.description)
            rows[doc.name] = doc
        for name, default in entry["defaults"].items():
            rows[name] = replace(rows[name], default=default)
    return list(rows.values())


def describe(config_cls: type) -> list[FieldDoc]:
    """Every field of a config class, in its declaration order."""
    return assemble([class_entry(c) for c in config_classes(config_cls)])


def sections(fields: list[FieldDoc]) -> list[tuple[str, list[FieldDoc]]]:
    """``fields`` grouped by section, in the order the sections first appear."""
    out: dict[str, list[FieldDoc]] = {}
    for f in fields:
        out.setdefault(f.section, []).append(f)
    return list(out.items())


# ---------------------------------------------------------------- the snapshot


def snapshot(methods: dict[str, type], options: dict[str, type]) -> dict:
    """The snapshot of ``methods`` (command -> config class): each class once, each command's classes;
    and of ``options`` (command -> its options class, ``options.py``): each command's options."""
    classes, commands = {}, {}
    for command, config_cls in methods.items():
        keys = []
        for cls in config_classes(config_cls):
            entry = class_entry(cls)
            key = f"{entry['source']}:{cls.__name__}"
            classes[key] = entry
            keys.append(key)
        commands[command] = keys
    return {"commands": commands, "classes": classes,
            "options": {command: options_entry(cls) for command, cls in options.items()}}


def _rows_text(rows: list[dict]) -> str:
    return ",\n".join("    " + json.dumps(row, ensure_ascii=False) for row in rows)


def snapshot_text(methods: dict[str, type], options: dict[str, type]) -> str:
    """``fields.json``'s text: one line per field or option, so a changed one is a one-line diff."""
    data = snapshot(methods, options)
    classes, commands = [], []
    for key, entry in data["classes"].items():
        head = json.dumps({k: v for k, v in entry.items() if k != "fields"}, ensure_ascii=False)[:-1]
        classes.append(f"  {json.dumps(key)}: {head}, \"fields\": [\n{_rows_text(entry['fields'])}\n  ]}}")
    for command, entry in data["options"].items():
        head = json.dumps({k: v for k, v in entry.items() if k != "options"}, ensure_ascii=False)[:-1]
        commands.append(f"  {json.dumps(command)}: {head}, \"options\": [\n{_rows_text(entry['options'])}\n  ]}}")
    return ('{"commands": ' + json.dumps(data["commands"]) + ',\n "classes": {\n' + ",\n".join(classes)
            + '\n },\n "options": {\n' + ",\n".join(commands) + "\n}}\n")


def _snapshot() -> dict:
    return _read_snapshot(SNAPSHOT)


@functools.lru_cache(maxsize=4)
def _read_snapshot(path: Path) -> dict:
    """The snapshot's data (read once per process: the three option commands read it at start-up)."""
    return json.loads(path.read_text(encoding="utf-8"))


def command_fields(command: str) -> list[FieldDoc]:
    """The fields of a training command's config: from the snapshot where every class of it is
    unchanged since it was written, else from the classes (importing the method's module)."""
    try:
        data = _snapshot()
        entries = [data["classes"][key] for key in data["commands"][command]]
        if all(_current(entry) for entry in entries):
            return assemble(entries)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return describe(METHODS[command].load()[0])


# ---------------------------------------------------------------- the options of eval, compare and demo


@dataclass(frozen=True)
class OptionDoc:
    """One option of ``grpolab eval``, ``compare`` or ``demo``, as its typer option takes it."""

    name: str
    flag: str
    default: Any  # as JSON (a path as its text); None also where the field's validator fills in the default
    required: bool
    description: str


def _json_default(field) -> Any:
    """The typer default of a field: its default (a path as text), None for a default factory
    (the option is not given: the field's validator fills in its value) or a required field."""
    if field.is_required() or field.default_factory is not None:
        return None
    value = field.default
    return value.as_posix() if isinstance(value, Path) else value


def options_entry(cls: type) -> dict:
    """An options class's options (flag, default, description) with the path and hash of the source
    of the classes of its module that make it (``CommandOptions`` and its own)."""
    path = Path(inspect.getsourcefile(cls)).resolve()
    classes = [c.__name__ for c in reversed(cls.__mro__) if c.__module__ == cls.__module__]
    rows = [asdict(OptionDoc(name, cls.flag(name), _json_default(field), field.is_required(),
                             " ".join((field.description or "").split())))
            for name, field in cls.model_fields.items()]
    return {"source": path.relative_to(PACKAGE).as_posix(), "classes": classes,
            "hash": source_hash(path, classes), "options": rows}


def command_options(command: str) -> dict[str, OptionDoc]:
    """The options of ``grpolab eval``, ``compare`` or ``demo`` by name: from the snapshot where
    their classes are unchanged since it was written, else from the classes (importing ``options.py``)."""
    try:
        entry = _snapshot()["options"][command]
        if _current(entry):
            return {row["name"]: OptionDoc(**row) for row in entry["options"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from .options import OPTIONS

    return {row["name"]: OptionDoc(**row) for row in options_entry(OPTIONS[command])["options"]}


def typer_options(command: str) -> Callable[[str], Any]:
    """``option(name)``: the typer option of the command's option ``name``, its flag, default and help
    those of its field (a boolean that defaults to true gets its ``--no-`` form too)."""
    docs = command_options(command)

    def option(name: str) -> Any:
        doc = docs[name]
        flag = f"{doc.flag}/--no-{doc.flag[2:]}" if doc.default is True else doc.flag
        return typer.Option(... if doc.required else doc.default, flag, help=doc.description)

    return option
