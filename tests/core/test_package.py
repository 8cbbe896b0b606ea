"""grpolab.core as a package: its public names (its layering, torch only, and its ``__init__``
re-exporting only are in tests/test_layers.py)."""


import grpolab.core


def test_every_public_name_is_importable():
    for name in grpolab.core.__all__:
        assert getattr(grpolab.core, name) is not None, name
    assert len(set(grpolab.core.__all__)) == len(grpolab.core.__all__)


def test_registries_hold_the_builtins():
    assert grpolab.core.policy_loss_names() == grpolab.core.LOSS_TYPES + ("gspo", "cispo", "sapo")
    assert grpolab.core.advantage_estimator_names() == ("grpo", "rloo", "reinforce_plus_plus")
