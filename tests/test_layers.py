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
other. The top-level ``grpolab/__init__.py`` and ``__main__.py`` stand outside the table, and are the only
modules at the top (no loose modules). Every ``__init__.py`` only imports, re-exports and holds plain data;
the methods are those of ``grpolab.algorithms.METHODS`` (every other file of ``algorithms/`` is a
``<method>_*.py`` helper of one); no modules import each other in a circle at import time.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from grpolab.algorithms import METHODS as METHOD_TABLE

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpolab"

LAYERS = {
    "core": 0, "models": 1, "rewards": 2, "rollout": 2, "data": 3, "envs": 3, "eval": 4, "training": 5,
    "algorithms": 6, "experiments": 7, "viewer": 7, "cli": 8,
}
# the methods of algorithms/ (their modules' names, from the commands' table): a file is its method's
# (``grpo.py``) or a helper private to it (``grpo_update.py``)
METHODS = tuple(method.module.rpartition(".")[2] for method in METHOD_TABLE.values())
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_grpolab_module(name: str) -> bool:
    """``name`` (dotted) is a module or package of grpolab here."""
    path = ROOT / Path(*name.split("."))
    return name.startswith("grpolab") and (path.with_suffix(".py").is_file() or path.is_dir())


BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)  # what a statement's body holds


def import_nodes(tree: ast.Module, top_level_only: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``: all, or with ``top_level_only`` those that run when the module
    is imported (not inside a function, nor under ``if TYPE_CHECKING:``)."""
    if not top_level_only:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, BLOCKS)]
    return found


def imported_modules(source: str, module: str, is_package: bool, top_level_only: bool = False) -> list[tuple[str, int]]:
    """Every module ``source`` (the text of ``module``) imports, resolved to its absolute dotted
    name, with the line: ``import a.b``, ``from a import b`` (``a.b`` where ``b`` is a module of
    grpolab, else ``a``) and relative imports alike, at any depth (inside functions too) or, with
    ``top_level_only``, those that run at import time."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in import_nodes(ast.parse(source), top_level_only):
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
                found.append((sub if is_grpolab_module(sub) else target, node.lineno))
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


# ---------------------------------------------------------------- __init__.py files only re-export


def is_plain_data(node: ast.expr, in_table: bool = False) -> bool:
    """A literal, a name, or a table of them (a dict, list, tuple or set); inside a table a row may be a
    record built from plain data (``Method("grpolab.algorithms.grpo", ...)``), but a value is never a call."""
    if isinstance(node, (ast.Constant, ast.Name, ast.Attribute)):
        return True
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(is_plain_data(e, True) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and is_plain_data(k, True) for k in node.keys) and all(
            is_plain_data(v, True) for v in node.values)
    if isinstance(node, ast.Call) and in_table:
        return is_plain_data(node.func) and all(is_plain_data(a, True) for a in node.args) and all(
            is_plain_data(k.value, True) for k in node.keywords)
    return False


def init_violations(module: str, source: str) -> list[str]:
    """What a package's ``__init__.py`` holds beyond imports, ``__all__``, a docstring and plain data."""
    out = []
    for i, node in enumerate(ast.parse(source).body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and is_plain_data(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) for t in targets):
                continue
        out.append(f"{module} (line {node.lineno}): an __init__.py only imports, re-exports and holds plain data; "
                   f"found {type(node).__name__} {ast.unparse(node).splitlines()[0][:60]!r}")
    return out


def test_every_init_only_imports_re_exports_and_holds_plain_data():
    found = []
    for path in package_files():
        if path.name == "__init__.py":
            found += init_violations(module_name(path), path.read_text(encoding="utf-8"))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source,found", [
    ("from .base import app\n\ndef main():\n    app()", "found FunctionDef 'def main():'"),
    ("class Method:\n    pass", "found ClassDef 'class Method:'"),
    ("import os\nif os.name == 'nt':\n    X = 1", "found If"),
    ("try:\n    import vllm\nexcept ImportError:\n    vllm = None", "found Try"),
    ("import typer\napp = typer.Typer()", "found Assign 'app = typer.Typer()'"),
    ("NAMES = [n for n in 'ab']", "found Assign"),
])
def test_an_init_that_does_more_is_named(source, found):
    assert any(found in v for v in init_violations("grpolab.cli", source)), init_violations("grpolab.cli", source)


def test_plain_data_in_an_init_passes():
    source = ('"""A docstring."""\n\nfrom __future__ import annotations\n\nfrom .base import Method, app\n\n'
              '__version__ = "0.1.0"\n'
              'METHODS = {"grpo": Method("grpolab.algorithms.grpo", "GRPOConfig", help="GRPO.")}\n'
              '__all__ = ["app", "METHODS"]\n')
    assert init_violations("grpolab.algorithms", source) == []


# ---------------------------------------------------------------- no loose modules; the methods of algorithms/


def loose_modules(names: list[str]) -> list[str]:
    """The files at the top of ``grpolab/`` that are neither ``__init__.py`` nor ``__main__.py``."""
    return sorted(n for n in names if n.endswith(".py") and n not in ("__init__.py", "__main__.py"))


def stray_algorithm_files(names: list[str], methods: tuple[str, ...]) -> list[str]:
    """The files of ``algorithms/`` that are neither a method's nor a ``<method>_*.py`` helper of one."""
    return sorted(n for n in names if n.endswith(".py") and n != "__init__.py"
                  and not any(n[:-3] == m or n.startswith(m + "_") for m in methods))


def test_the_package_top_holds_no_loose_modules():
    assert loose_modules([p.name for p in PACKAGE.iterdir()]) == []
    assert loose_modules(["__init__.py", "__main__.py", "demo.py", "cli"]) == ["demo.py"]


def test_the_methods_are_the_commands_table_and_every_other_algorithms_file_is_a_methods_helper():
    assert len(METHODS) == len(METHOD_TABLE) >= 6
    for name, method in METHOD_TABLE.items():
        assert method.module.startswith("grpolab.algorithms."), f"{name}: {method.module} is not in algorithms/"
        assert (ROOT / Path(*method.module.split("."))).with_suffix(".py").is_file(), f"{name}: no {method.module}"
    assert stray_algorithm_files([p.name for p in (PACKAGE / "algorithms").glob("*.py")], METHODS) == []
    assert stray_algorithm_files(["__init__.py", "grpo.py", "grpo_update.py", "common.py"], ("grpo",)) == ["common.py"]


# ---------------------------------------------------------------- no import cycle


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the grpolab modules it imports when it is imported (imports inside functions are no
    edges), from ``sources``: module -> (its text, whether it is a package's ``__init__``)."""
    graph = {}
    for module, (source, is_package) in sources.items():
        targets = {t for t, _ in imported_modules(source, module, is_package, top_level_only=True)}
        graph[module] = {t for t in targets if t in sources and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One circle (``a -> b -> a``) per group of modules that import each other (Tarjan's SCCs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [" -> ".join(_circle(graph, set(group))) for group in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph[node] & group):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                todo.append(nxt)
    return sorted(group)


def test_no_modules_import_each_other_in_a_circle():
    sources = {module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py") for p in package_files()}
    cycles = import_cycles(import_graph(sources))
    assert not cycles, "modules that import each other at import time:\n" + "\n".join(cycles)


@pytest.mark.parametrize("sources,expected", [
    ({"grpolab.data.prompts.chat": ("from .templates import load_template", False),
      "grpolab.data.prompts.templates": ("from .chat import ChatTemplate", False)},
     ["grpolab.data.prompts.chat -> grpolab.data.prompts.templates -> grpolab.data.prompts.chat"]),
    ({"grpolab.cli": ("from .base import app\nfrom . import train", True),
      "grpolab.cli.base": ("import typer", False),
      "grpolab.cli.train": ("from . import app", False)},
     ["grpolab.cli -> grpolab.cli.train -> grpolab.cli"]),
    ({"grpolab.data.prompts.chat": ("def f():\n    from .templates import load_template", False),
      "grpolab.data.prompts.templates": ("from .chat import ChatTemplate", False)}, []),
    ({"grpolab.cli": ("from .base import app\nfrom . import train", True),
      "grpolab.cli.base": ("import typer", False),
      "grpolab.cli.train": ("from .base import app", False)}, []),
])
def test_an_import_cycle_is_named_with_its_modules(sources, expected):
    assert import_cycles(import_graph(sources)) == expected


# grpolab modules imported inside a function outside cli/ (DESIGN: only cli/, for its start-up time, and
# optional dependencies defer imports), each with the reason it must wait: module -> imported modules
DEFERRED_IMPORTS = {
    # the reward worker runs as a script under `python -I`: sys.path and its memory limit come first
    "grpolab.rewards.reward_worker": {"grpolab.rewards.registry"},
    # grpolab.rewards imports without torch (reward workers, the viewer); a reward model loads it when used
    "grpolab.rewards.reward_model": {"grpolab.models.classifier", "grpolab.models.loading"},
    # grpolab view imports run_dir: without torch (these two import it) its start-up stays ~0.2 s, not ~6 s
    "grpolab.training.run_dir": {"grpolab.training.distributed", "grpolab.training.checkpoints"},
}


def deferred_imports(module: str, source: str, is_package: bool = False) -> set[str]:
    """The grpolab modules ``module`` imports inside a function and nowhere at its top level."""
    tree = ast.parse(source)
    inside = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside += [sub for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))]
    body = ast.Module(body=inside, type_ignores=[])
    everywhere = {target for target, _ in imported_modules(ast.unparse(body), module, is_package)}
    top = {target for target, _ in imported_modules(source, module, is_package, top_level_only=True)}
    return {t for t in everywhere - top if t.startswith("grpolab")}


def test_grpolab_modules_are_imported_inside_functions_only_where_a_reason_is_listed():
    found = {}
    for path in package_files():
        module = module_name(path)
        if module.split(".")[1:2] == ["cli"]:
            continue
        deferred = deferred_imports(module, path.read_text(encoding="utf-8"), path.name == "__init__.py")
        if deferred - DEFERRED_IMPORTS.get(module, set()):
            found[module] = sorted(deferred - DEFERRED_IMPORTS.get(module, set()))
    assert not found, f"import these at the top, or list the reason in DEFERRED_IMPORTS: {found}"
    stale = {m: sorted(ts) for m, ts in DEFERRED_IMPORTS.items()
             if not ts <= deferred_imports(m, (ROOT / Path(*m.split("."))).with_suffix(".py").read_text())}
    assert not stale, f"DEFERRED_IMPORTS lists imports that are no longer deferred: {stale}"


def test_a_deferred_import_is_found():
    source = "from . import registry\n\ndef f():\n    from ..models import loading\n    from . import registry\n"
    assert deferred_imports("grpolab.rewards.scoring", source) == {"grpolab.models.loading"}
