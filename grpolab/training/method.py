"""A training command as a record: the module that holds it, the names of its config class and
trainer there, and its ``--help``. ``load`` imports the module only when the command runs."""

from __future__ import annotations

import importlib
from typing import NamedTuple


class Method(NamedTuple):
    """A training command: the module holding it, its config class and trainer, and its ``--help``."""

    module: str
    config: str
    trainer: str
    help: str

    def load(self):
        """``(config class, trainer function)``, importing the method's module."""
        module = importlib.import_module(self.module)
        return getattr(module, self.config), getattr(module, self.trainer)
