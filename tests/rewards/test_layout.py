"""Package rules for grpolab/rewards: ``__init__`` only re-exports, modules stay under 400 lines,
and nothing outside the package imports its private (underscore) names."""

import ast
from pathlib import Path

import grpolab.rewards

REWARDS = Path(grpolab.rewards.__file__).parent
ROOT = REWARDS.parents[1]


def test_init_only_re_exports():
    tree = ast.parse((REWARDS / "__init__.py").read_text())
    assert all(isinstance(n, (ast.ImportFrom, ast.Import, ast.Assign, ast.Expr)) for n in tree.body)
    for name in grpolab.rewards.__all__:
        obj = getattr(grpolab.rewards, name)
        assert getattr(obj, "__module__", "grpolab.rewards.x") != "grpolab.rewards", name


def test_modules_are_under_400_lines():
    for path in REWARDS.glob("*.py"):
        assert len(path.read_text().splitlines()) < 400, path.name


def _imports_of_private_reward_names(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and "rewards" in node.module:
            found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if "rewards" in base.split("."):
                found.append(f"{path.relative_to(ROOT)}: {base}.{node.attr}")
    return found


def test_no_private_reward_names_are_imported_from_outside():
    outside = [p for folder in ("grpolab", "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py")
               if REWARDS not in p.parents]
    offenders = [hit for p in outside for hit in _imports_of_private_reward_names(p)]
    assert offenders == []
