"""Reading a config file safely: safe YAML (no Python tags), at most ``MAX_CONFIG_BYTES``, no duplicate
key, aliases that expand to at most ``MAX_ALIAS_VALUES`` values; every failure is one ``ConfigError``
line naming the file (and the line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad config; the message names the file or key."""


MAX_CONFIG_BYTES = 10 * 2**20  # a config is a few KB; a bigger file is a mistake (a checkpoint, a log)
MAX_ALIAS_VALUES = 100_000  # values that aliases may add to a document (a billion-laughs file: billions)
MISSING_KEY = object()


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base`: keys given beside it override the merged ones, as YAML says
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the constructor's own error names it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _alias_values(root) -> int:
    """How many values aliases add to the document ``root`` (a node graph: an alias is the anchored
    node itself), counted without expanding them; a node that contains itself raises."""
    sizes: dict[int, int] = {}
    distinct = 0

    def size(node, open_nodes: set[int]) -> int:
        nonlocal distinct
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise yaml.composer.ComposerError(None, None, "a recursive alias (a value that contains itself)",
                                              node.start_mark)
        distinct += 1
        children = node.value if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)) else ()
        open_nodes.add(key)
        total = 1
        for child in children:
            for part in (child if isinstance(child, tuple) else (child,)):
                total += size(part, open_nodes)
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root, set()) - distinct


def load_yaml(text: str) -> Any:
    """``text`` as YAML (``_ConfigLoader``: safe, no duplicate keys, aliases bounded); yaml.YAMLError
    on a refusal, with a mark where there is one."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        added = _alias_values(node)
        if added > MAX_ALIAS_VALUES:
            raise yaml.composer.ComposerError(
                None, None, f"aliases expand it by {added} values, more than {MAX_ALIAS_VALUES}: a YAML alias bomb?")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path) -> Any:
    """A YAML file read by ``load_yaml``; a ConfigError of one line naming the file (and the line)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{path}: is a directory, not a config file")
    if not p.is_file():
        raise ConfigError(f"{path}: no such config file")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size} bytes, larger than a config may be ({MAX_CONFIG_BYTES // 2**20} MB)")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") \
            from None
    try:
        return load_yaml(text)
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML (nested too deeply)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        reason = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line (a ReaderError spans two)
        raise ConfigError(f"{path}{where}: invalid YAML ({reason})") from None


