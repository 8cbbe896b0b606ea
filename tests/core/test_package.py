"""grpolab.core as a package: its public names (its layering, torch only, is in tests/test_layers.py)."""

import ast
import pathlib

import grpolab.core


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
