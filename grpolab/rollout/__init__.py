"""Generation backends behind one interface (see ``base``); ``make_backend`` (``backends``) builds one by name."""

from .backends import HF_OPTIONS, make_backend
from .base import FINISH_REASONS, Rollout, RolloutBackend, RolloutBackendError, SamplingParams, WeightSyncError
from .hf import HFRolloutBackend

__all__ = ["FINISH_REASONS", "HF_OPTIONS", "HFRolloutBackend", "Rollout", "RolloutBackend", "RolloutBackendError",
           "SamplingParams", "WeightSyncError", "make_backend"]
