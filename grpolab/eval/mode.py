"""Evaluation forwards run with dropout off and without autograd."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def eval_mode(model) -> Iterator:
    """``model.eval()`` and ``torch.inference_mode()`` for the block; afterwards every submodule
    gets back its own training flag (a frozen sub-model that was in eval mode stays so).

    Dropout left on would make perplexity and entropy random and biased: the figures would
    describe a model that is never sampled from.
    """
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.inference_mode():
            yield model
    finally:
        for module, training in flags:
            module.training = training
