"""The package's shape as code: the layer table of DESIGN.md ("Layout") over the ``ast`` import graph
of ``grpolab/``, and the sizes a reader holds in mind. A wrong import fails here naming both modules.

| layer | folders                  | may import                         |
|-------|--------------------------|------------------------------------|
| L0    | core                     | torch, the standard library        |
| L1    | models                   | core                               |
| L2    | rewards, rollout         | L0-L1                              |
| L3    | data, envs               | L0-L2                              |
| L4    | eval                     | L0-L3                              |
| L5    | training                 | L0-L4 (what every method shares)   |
| L6    | algorithms               | L0-L5; a method never imports another method |
| L7    | experiments, viewer      | L0-L6                              |
| L8    | cli                      | anything                           |

Each folder imports its own modules and lower layers only; two folders of one layer never import each
other. The top-level ``grpolab/__init__.py`` and ``__main__.py`` stand outside the table.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpolab"

LAYERS = {
    "core": 0, "models": 1, "rewards": 2, "rollout": 2, "data": 3, "envs": 3, "eval": 4, "training": 5,
    "algorithms": 6, "experiments": 7, "viewer": 7, "cli": 8,
}
# the methods of algorithms/: a file is its method's (``grpo.py``) or a helper private to it (``grpo_update.py``)
METHODS = ("expert_iteration", "grpo", "ppo", "sft", "dpo", "rm")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    """Every module ``source`` (the text of ``module``) imports, resolved to its absolute dotted
    name, with the line: ``import a.b``, ``from a import b`` (``a.b`` where ``b`` is a module of
    grpolab, else ``a``) and relative imports alike, at any depth (inside functions too)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = target.startswith("grpolab") and (
                    (ROOT / Path(*sub.split("."))).with_suffix(".py").is_file()
                    or (ROOT / Path(*sub.split("."))).is_dir()
                )
                found.append((sub if is_module else target, node.lineno))
    return found


def method_of(module: str) -> str | None:
    """The method an ``algorithms`` module belongs to (``grpolab.algorithms.grpo_update`` -> grpo)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "algorithms":
        return None
    stem = parts[2]
    return next((m for m in METHODS if stem == m or stem.startswith(m + "_")), None)


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """The layer rules ``module`` breaks, one line each naming both modules."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return []
    folder, out = parts[1], []
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for target, line in imported_modules(source, module, is_package):
        top = target.split(".")[0]
        if top != "grpolab":
            if folder == "core" and top not in stdlib and top != "torch":
                out.append(f"{module} (line {line}) imports {target}: core imports torch and the standard library only")
            continue
        other = target.split(".")[1] if target.count(".") else None
        if other is None or other not in LAYERS or other == folder:
            mine, theirs = method_of(module), method_of(target)
            if mine and theirs and mine != theirs:
                out.append(f"{module} (line {line}) imports {target}: a method never imports another method")
            continue
        if LAYERS[other] > LAYERS[folder]:
            out.append(f"{module} (line {line}) imports {target}: {folder} (L{LAYERS[folder]}) may not import "
                       f"{other} (L{LAYERS[other]}), a higher layer")
        elif LAYERS[other] == LAYERS[folder]:
            out.append(f"{module} (line {line}) imports {target}: {folder} and {other} are one layer "
                       f"(L{LAYERS[folder]}) and never import each other")
    return out


def package_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100, f"only {len(files)} files under {PACKAGE}"
    return files


def test_every_folder_is_in_the_layer_table():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS), f"folders not in the table: {folders - set(LAYERS)}; gone: {set(LAYERS) - folders}"


def test_the_package_follows_the_layer_table():
    found = []
    for path in package_files():
        found += violations(module_name(path), path.read_text(encoding="utf-8"), path.name == "__init__.py")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module,source,expected", [
    ("grpolab.training.run", "from ..algorithms.grpo import GRPOConfig",
     "grpolab.training.run (line 1) imports grpolab.algorithms.grpo: training (L5) may not import algorithms (L6)"),
    ("grpolab.core.losses", "import numpy", "grpolab.core.losses (line 1) imports numpy: core imports torch"),
    ("grpolab.core.losses", "def f():\n    from grpolab.models import load_model",
     "grpolab.core.losses (line 2) imports grpolab.models: core (L0) may not import models (L1)"),
    ("grpolab.data.tasks.gym", "from ...envs import build_env",
     "grpolab.data.tasks.gym (line 1) imports grpolab.envs: data and envs are one layer"),
    ("grpolab.algorithms.expert_iteration", "from .sft import train_sft",
     "grpolab.algorithms.expert_iteration (line 1) imports grpolab.algorithms.sft: a method never imports another"),
    ("grpolab.algorithms.grpo_update", "from . import ppo",
     "grpolab.algorithms.grpo_update (line 1) imports grpolab.algorithms.ppo: a method never imports another"),
])
def test_a_wrong_import_is_named_with_both_modules(module, source, expected):
    assert any(v.startswith(expected) for v in violations(module, source)), violations(module, source)


@pytest.mark.parametrize("module,source", [
    ("grpolab.algorithms.grpo", "from .grpo_update import accumulate_policy_gradient\nfrom ..training import run"),
    ("grpolab.cli.train", "from ..algorithms import METHODS\nfrom ..experiments.demo import run_demo"),
    ("grpolab.core.kl", "import math\nimport torch\nfrom .masking import masked_mean"),
])
def test_allowed_imports_pass(module, source):
    assert violations(module, source) == []


def test_no_file_over_400_lines_and_no_function_over_80():
    long_files, long_functions = [], []
    for path in package_files():
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not long_files and not long_functions, "\n".join(long_files + long_functions)
