"""Package rules for grpolab/rewards: nothing outside the package imports its private (underscore)
names. (``__init__`` re-exporting only and the 400-line bound hold for every package: tests/test_layers.py.)"""

import ast
from pathlib import Path

import grpolab.rewards

REWARDS = Path(grpolab.rewards.__file__).parent
ROOT = REWARDS.parents[1]


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
