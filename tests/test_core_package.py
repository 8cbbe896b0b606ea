"""grpolab.core as a package: its layering (torch only) and its public names."""

import ast
import pathlib

import grpolab.core


def test_core_imports_nothing_but_torch():
    import sys

    core = pathlib.Path(__file__).resolve().parents[1] / "grpolab" / "core"
    stdlib = set(sys.stdlib_module_names)
    for path in core.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    continue
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top == "torch" or top in stdlib or top == "__future__", f"{path.name} imports {name}"



def test_every_public_name_is_importable():
    for name in grpolab.core.__all__:
        assert getattr(grpolab.core, name) is not None, name
    assert len(set(grpolab.core.__all__)) == len(grpolab.core.__all__)


def test_init_only_re_exports():
    init = pathlib.Path(grpolab.core.__file__)
    for node in ast.parse(init.read_text()).body:
        is_docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        is_all = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        assert is_docstring or is_all or isinstance(node, ast.ImportFrom), ast.dump(node)[:80]


def test_registries_hold_the_builtins():
    assert grpolab.core.policy_loss_names() == grpolab.core.LOSS_TYPES + ("gspo", "cispo", "sapo")
    assert grpolab.core.advantage_estimator_names() == ("grpo", "rloo", "reinforce_plus_plus")
