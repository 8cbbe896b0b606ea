"""The real model comes from the cache ``make test-real`` fills (``scripts/real_model.py``). Where
it could not be had, every test here is skipped with the one-line reason, never silently."""

import pytest

from tests.helpers.skips import skip_folder
from tests.real import real_model

MODEL_DIR, REASON = real_model.status()


def pytest_collection_modifyitems(config, items):
    skip_folder(items, "real", None if REASON is None else f"real model unavailable: {REASON}")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted SmolLM2-135M-Instruct directory (safetensors, float32)."""
    if MODEL_DIR is None:
        pytest.skip(f"real model unavailable: {REASON}")
    return MODEL_DIR


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """``(model, tokenizer)`` through grpolab's own loader, float32, eval mode; loaded once per
    session: tests must not change the weights (copy them first)."""
    from grpolab.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(smollm2_dir), dtype="float32")
    return model.eval(), tokenizer
