"""grpolab command line: ``grpolab demo``, ``grpolab grpo``, ``grpolab sft``.

Every training command takes ``--config FILE.yaml`` and any config field as ``--field value``
(dashes or underscores), e.g. ``grpolab grpo --config configs/grpo_tiny.yaml --n-grpo-steps 20``.
The app and what the commands share are in ``base``; each command module registers its commands
on the app when imported, below in the order ``grpolab --help`` lists them.
"""

from .base import app, boolean_flag_values, main

# isort: off
from . import train, eval, compare, tools, serve, config  # noqa: F401
# isort: on

__all__ = ["app", "boolean_flag_values", "main"]
