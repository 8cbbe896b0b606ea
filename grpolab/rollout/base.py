"""The rollout interface: ``backend.generate(prompts, n, sampling) -> list[Rollout]``.

A backend returns ``n`` rollouts per prompt, prompt-major (the ``n`` samples of prompt ``i`` are
consecutive: exactly the groups GRPO normalises over). Each rollout keeps the exact sampled token
ids, so training scores the very tokens that were sampled, never a re-tokenisation. A backend
that holds its own copy of the weights (vLLM) implements ``sync_weights(model)``; the Hugging Face
backend samples from the training model itself, so its ``sync_weights`` does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

FINISH_REASONS = ("stop", "eos", "length")


@dataclass
class SamplingParams:
    """Sampling settings, named as in vLLM.

    ``min_tokens`` forbids eos and stop strings before that many tokens (no empty responses);
    a stop string is kept in the output (``</answer>`` ends the answer and stays in it).
    ``temperature == 0`` is greedy decoding.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be within [0, max_tokens={self.max_tokens}], got {self.min_tokens}")


@dataclass
class Rollout:
    """One sampled response.

    ``logprobs[i]`` is the sampler's log-probability of ``response_ids[i]`` under the model's
    untempered distribution (temperature 1, before top-p), which is what the trainer computes.
    ``finish_reason``: ``stop`` (a stop string), ``eos``, or ``length`` (hit ``max_tokens``).
    """

    prompt: str
    response: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_index: int = 0


class RolloutBackend(Protocol):
    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> list[Rollout]: ...

    def sync_weights(self, model) -> None: ...
