"""The rollout interface: ``backend.generate(prompts, n, sampling) -> list[Rollout]``.

A backend returns ``n`` rollouts per prompt, prompt-major (the ``n`` samples of prompt ``i`` are
consecutive: exactly the groups GRPO normalises over). Each rollout keeps the exact sampled token
ids, so training scores the very tokens that were sampled, never a re-tokenisation. A backend
that holds its own copy of the weights (vLLM) implements ``sync_weights(model)``; the Hugging Face
backend samples from the training model itself, so its ``sync_weights`` does nothing.
"""

from __future__ import annotations

import math
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


class WeightSyncError(RolloutBackendError):
    """The sync canary: after a weight sync the sampler's weights differ from the trainer's (a tensor
    not sent, or not loaded: veRL #7495's LoRA sync delivered nothing for two months). One line."""


CANARY_VALUES = 65_536  # values a tensor's fingerprint reads at most (a fixed stride over the flat tensor)


def tensor_sums(t, max_values: int | None = CANARY_VALUES) -> tuple[float, float, int]:
    """``(sum, sum of squares, count)`` of a tensor's values, accumulated in float64: the canary's
    fingerprint, over every ``ceil(numel / max_values)``-th value (the same ones on both sides of a
    sync; a stale or unloaded tensor moved everywhere an update moved it). The squares are taken in
    the tensor's own dtype, so equal tensors give equal terms and only the addition order may differ."""
    import torch

    flat = t.detach().reshape(-1)
    if max_values is not None and flat.numel() > max_values:
        flat = flat[:: -(-flat.numel() // max_values)]
    return float(flat.sum(dtype=torch.float64)), float((flat * flat).sum(dtype=torch.float64)), flat.numel()


def sums_differ(a: tuple[float, float, int], b: tuple[float, float, int]) -> bool:
    """Whether two ``tensor_sums`` are of different tensors: beyond the error of adding the same n
    float64 terms in another tree order (16 log2(n) eps64 of the terms' magnitude; ``sqrt(n x sum of
    squares)`` bounds it for the plain sum). Equal tensors in the sampler's dtype give equal terms, so
    the tolerance is float64's, not the sampler dtype's."""
    if a[2] != b[2]:
        return True
    n = max(a[2], 1)
    eps = 16 * math.log2(n + 1) * 2.0 ** -52
    scale_sq = max(abs(a[1]), abs(b[1]))
    return abs(a[1] - b[1]) > eps * scale_sq + 1e-300 or abs(a[0] - b[0]) > eps * (n * scale_sq) ** 0.5 + 1e-300


def sync_problem(expected: dict, held: dict, aliases: list[list[str]]) -> str | None:
    """What is wrong with a sync, in words, or None: ``expected`` maps each name sent to its
    ``tensor_sums`` (as cast to the sampler's dtype), ``held`` each name the sampler holds to the
    sums of what it holds; ``aliases`` groups the sampler's names of one tensor (tied weights:
    sending either name suffices)."""
    for names in aliases:
        sent = [n for n in names if n in expected]
        if not sent:
            return f"{names[0]} was not sent (the sampler kept its old value)"
        if sums_differ(expected[sent[0]], held[names[0]]):
            return f"{names[0]} differs (sum {held[names[0]][0]:.9g} held vs {expected[sent[0]][0]:.9g} sent)"
    return None


def probe_ids(vocab_size: int, length: int = 32) -> list[int]:
    """The canary's fixed probe sequence for an engine that cannot hand its weights back (vLLM):
    ``length`` ids spread over the vocabulary (no tokenizer needed; any ids are a sequence)."""
    return [(1 + 7919 * i) % vocab_size for i in range(length)]


def probe_tolerance(dtype) -> float:
    """The most mean |log-prob difference| per probe token the canary allows between the trainer's
    float32 forward and an engine holding ``dtype`` weights: 8 x the dtype's eps, at least 1e-3
    (bfloat16: 0.0625, float16: 0.0078). Measured on the tiny model, vLLM on the CPU: a sync that
    arrived 1.1e-7 (float32) and 1.6e-3 (bfloat16); one tensor stale after a 1e-3 step 2.5e-3
    (float32: caught); nothing synced after a 1e-2 step 0.2 (caught by both). SmolLM2's bf16
    sampler/trainer gap is ~0.02."""
    import torch

    return max(1e-3, 8 * torch.finfo(dtype).eps)


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
