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


class RolloutBackendError(RuntimeError):
    """A backend in a process of its own (a sampler process, a vLLM server) died or stopped answering;
    the message is one line. The run stops; its newest checkpoint resumes it."""


@dataclass
class SamplingParams:
    """Sampling settings, named as in vLLM.

    The policy sampled is ``softmax(logits / temperature)`` restricted to the top-p nucleus (the
    smallest set of most likely tokens whose mass reaches ``top_p``, as Hugging Face and vLLM);
    ``temperature == 0`` is greedy decoding.
    A stop string ends a response however the model spells it (one token, several, or a token that
    runs past its end: matched on the decoded text), at its first occurrence, and is kept in the
    output (``</answer>`` ends the answer and stays in it). A response also ends on any of the
    model's end ids (the tokenizer's eos and ``generation_config.eos_token_id``).
    ``min_tokens`` forbids the end ids and single-token stop strings before that many tokens (no
    empty responses); a stop string ends a response only when it ends after the first
    ``min_tokens`` tokens (vLLM's rule: the end, however spelled, comes after ``min_tokens``).
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
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass
class Rollout:
    """One sampled response.

    ``logprobs[i]`` is the sampler's log-probability of ``response_ids[i]`` under the tempered
    distribution ``log_softmax(logits / temperature)``, before top-p truncation (TRL/veRL
    convention: what the trainer computes with the logits divided by the sampling temperature). At
    ``temperature == 0`` (greedy) it is the untempered ``log_softmax(logits)``.
    ``response_ids`` are the exact sampled ids, the end token or the stop string's last token
    included; ``response`` is their text without special tokens, cut right after the stop string
    when the token that completed it runs past it (its id stays in ``response_ids``).
    ``finish_reason``: ``stop`` (a stop string), ``eos`` (an end id), or ``length`` (hit
    ``max_tokens``).
    """

    prompt: str
    response: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_index: int = 0
    # multi-turn rollouts (``grpolab.envs``): per response token, True where the model sampled it
    # and False for observation tokens the environment inserted (those leave every loss); None
    # means every token was sampled. ``info`` holds per-rollout figures (tool calls, turns, ...).
    loss_mask: list[bool] | None = None
    info: dict = field(default_factory=dict)
    # multi-turn rollouts: the model's own turns only (observation text removed); None for a
    # single-turn rollout, whose ``response`` is all the model's
    model_response: str | None = None
    # chat-format multi-turn rollouts: what followed the prompt as chat messages (assistant turns
    # with their ``tool_calls``, ``tool`` results, an environment's replies), for rewards that read
    # a conversation (a verifiers rubric); None otherwise
    messages: list[dict] | None = None

    @property
    def scored_response(self) -> str:
        """The text a reward reads: only what the model wrote. A tool's observation (a retrieved
        passage, a custom tool's output) can never plant the answer the verifier scores."""
        return self.response if self.model_response is None else self.model_response


class RolloutBackend(Protocol):
    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams,
                 prompt_ids: Sequence[list[int]] | None = None) -> list[Rollout]:
        """``n`` rollouts per prompt, prompt-major. ``prompt_ids``, when given, are the prompts'
        exact token ids (a multi-turn context: earlier sampled ids and observation tokens), used
        as they are instead of tokenising ``prompts`` (which then only label the rollouts)."""
        ...

    def sync_weights(self, model) -> None:
        """Give the backend ``model``'s current weights (after an update)."""
        ...

    def close(self) -> None:
        """Free what the backend holds (a vLLM engine); the HF backend holds nothing."""
        ...


def prompt_token_ids(tokenizer, prompts: Sequence[str], prompt_ids: Sequence[list[int]] | None) -> list[list[int]]:
    """The prompts' token ids: ``prompt_ids`` as given (checked against the prompt count), else the
    prompts tokenised without special tokens (templates carry their own)."""
    if prompt_ids is None:
        return tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    if len(prompt_ids) != len(prompts):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} entries for {len(prompts)} prompts")
    return [list(ids) for ids in prompt_ids]


def model_end_ids(model, tokenizer) -> list[int]:
    """The ids that end a response: the tokenizer's eos and ``generation_config.eos_token_id``
    (an int or a list: chat models list several, e.g. ``<|im_end|>`` and ``<|endoftext|>``)."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in [extra] if isinstance(extra, int) else list(extra or []):
        if int(i) not in ids:
            ids.append(int(i))
    return ids
