"""Multi-turn rollouts: the model writes until a tool call's closing tag, the environment runs the
call and appends the observation, and the model continues, up to ``env.max_turns`` turns and
``env.max_total_tokens`` tokens after the prompt (Search-R1 / ReSearch style rollouts).

Exactness. The model's tokens are the ids the backend sampled, with the sampler's log-probs; an
observation is tokenised once (``add_special_tokens=False``) and its ids are appended to the
context as they are, so the next turn continues from exactly the ids the trainer will score.
``Rollout.loss_mask`` is True for sampled tokens and False for observation tokens (log-prob 0.0):
the trainer ANDs it into the response mask, so observations never receive gradient.

Scoring. ``Rollout.response`` is the whole transcript (model turns and observations: what the
model saw); ``Rollout.model_response`` is the model's turns only, and it is what every reward
reads (``Rollout.scored_response``): an observation can never plant the answer.

Batching. The first turn samples ``n`` per prompt in one ``backend.generate`` call; every later
turn sends all live rollouts, each with its own context ids, in one call with ``n=1``. Rollouts
stay prompt-major, as the backends return them. Randomness is the backend's: with
``sampling.seed`` set, turn ``t`` samples with ``seed + t`` (reproducible, and no two turns reuse a
stream); without it the backend's generator carries the state across turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..rollout import Rollout, SamplingParams
from .base import ToolCall, ToolEnv


@dataclass
class _Trace:
    """One rollout in progress: everything after the prompt, and its counters."""

    prompt: str
    prompt_ids: list[int]
    prompt_index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    text: str = ""
    model_text: str = ""
    finish_reason: str = "length"
    calls: int = 0
    errors: int = 0
    turns: int = 0
    obs_tokens: int = 0
    truncated: int = 0
    done: bool = False

    def add_turn(self, out: Rollout) -> None:
        self.ids += out.response_ids
        self.logprobs += out.logprobs
        self.mask += [True] * len(out.response_ids)
        self.text += out.response
        self.model_text += out.response
        self.finish_reason = out.finish_reason
        self.turns += 1

    def add_observation(self, text: str, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [False] * len(ids)
        self.text += text
        self.obs_tokens += len(ids)

    def rollout(self) -> Rollout:
        info = {"tool_calls": self.calls, "tool_errors": self.errors, "turns": self.turns,
                "observation_tokens": self.obs_tokens, "model_tokens": len(self.ids) - self.obs_tokens,
                "truncated_observations": self.truncated}
        return Rollout(prompt=self.prompt, response=self.text, prompt_ids=list(self.prompt_ids), response_ids=self.ids,
                       logprobs=self.logprobs, finish_reason=self.finish_reason, prompt_index=self.prompt_index,
                       loss_mask=self.mask, info=info, model_response=self.model_text)


def _turn_sampling(sampling: SamplingParams, env: ToolEnv, turn: int, remaining: int) -> SamplingParams:
    """This turn's settings: the tool closers added to the stop strings, at most the tokens left."""
    max_tokens = max(1, min(sampling.max_tokens, remaining))
    return dataclasses.replace(sampling, stop=env.stop_strings(sampling.stop), max_tokens=max_tokens,
                               min_tokens=min(sampling.min_tokens, max_tokens),
                               seed=None if sampling.seed is None else sampling.seed + turn)


def _tokenizer_of(backend, tokenizer):
    tokenizer = tokenizer if tokenizer is not None else getattr(backend, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("multi-turn rollouts need the tokenizer (pass tokenizer=, or a backend with .tokenizer)")
    return tokenizer


def rollouts(backend, env: ToolEnv, prompts: Sequence[str], n: int, sampling: SamplingParams,
             prompt_ids: Sequence[list[int]] | None = None, tokenizer=None) -> list[Rollout]:
    """``n`` multi-turn rollouts per prompt, prompt-major (see the module docstring)."""
    tokenizer = _tokenizer_of(backend, tokenizer)
    first = backend.generate(list(prompts), n, _turn_sampling(sampling, env, 0, env.max_total_tokens),
                             prompt_ids=prompt_ids)
    traces = [_Trace(r.prompt, list(r.prompt_ids), r.prompt_index) for r in first]
    outputs = first
    live = list(range(len(traces)))
    for turn in range(env.max_turns):
        calls: list[tuple[int, ToolCall]] = []
        for i, out in zip(live, outputs):
            trace = traces[i]
            trace.add_turn(out)
            call = env.parse_call(out.response) if out.finish_reason == "stop" else None
            if call is None:
                trace.done = True
            else:
                trace.calls += 1
                calls.append((i, call))
        if not calls:
            break
        results = env.run_calls([c for _, c in calls])
        live = []
        for (i, _), result in zip(calls, results):
            trace = traces[i]
            trace.errors += result.error is not None
            if turn + 1 >= env.max_turns:
                continue  # a call in the last turn gets no observation
            text, truncated = env.render(result, tokenizer)
            trace.truncated += truncated
            obs_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(trace.ids) + len(obs_ids) >= env.max_total_tokens:
                trace.finish_reason = "length"  # no room left to read the observation and answer
                continue
            trace.add_observation(text, obs_ids)
            live.append(i)
        if not live:
            break
        contexts = [traces[i].prompt_ids + traces[i].ids for i in live]
        budgets = [env.max_total_tokens - len(traces[i].ids) for i in live]
        outputs = _continue(backend, tokenizer, [traces[i].prompt for i in live], contexts, sampling, env, turn + 1,
                            budgets)
    return [t.rollout() for t in traces]


def _continue(backend, tokenizer, prompts, contexts, sampling, env, turn, budgets) -> list[Rollout]:
    """One later turn for every live rollout in one ``generate`` call (``n=1``, exact context ids),
    sampled up to the largest budget left; a row that ran past its own budget is cut there
    (finish reason ``length``)."""
    outs = backend.generate(prompts, 1, _turn_sampling(sampling, env, turn, max(budgets)), prompt_ids=contexts)
    return [out if len(out.response_ids) <= budget else dataclasses.replace(
        out, response_ids=out.response_ids[:budget], logprobs=out.logprobs[:budget], finish_reason="length",
        response=tokenizer.decode(out.response_ids[:budget], skip_special_tokens=True))
        for out, budget in zip(outs, budgets)]


class EnvBackend:
    """A backend that runs ``env`` around another backend: ``generate(prompts, n, sampling)``
    returns multi-turn rollouts, so code written for a backend (``evaluate``, a trainer's sampling
    phase, ``grpolab eval``/``compare``) uses the environment unchanged."""

    def __init__(self, backend, env: ToolEnv, tokenizer=None, template=None):
        self.backend, self.env = backend, env
        self.tokenizer = _tokenizer_of(backend, tokenizer)
        if template is not None and callable(getattr(env, "bind", None)):
            env.bind(template)  # native function calling: the prompts render the tools; an environment finds its rows

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams,
                 prompt_ids: Sequence[list[int]] | None = None) -> list[Rollout]:
        own = getattr(self.env, "rollouts", None)  # an environment with a loop of its own (native function calling)
        if own is not None:
            return own(self.backend, prompts, n, sampling, prompt_ids, self.tokenizer)
        return rollouts(self.backend, self.env, prompts, n, sampling, prompt_ids, self.tokenizer)

    def sync_weights(self, model, **weights) -> None:
        self.backend.sync_weights(model, **weights)

    def __getattr__(self, name: str) -> Any:  # model, end_ids, ... of the wrapped backend
        return getattr(self.backend, name)


def apply_call_cost(scores: list[dict], rollouts_: Sequence[Rollout], cost: float) -> list[dict]:
    """Scores with ``cost`` x tool calls subtracted from ``reward`` (and ``tool_cost`` recorded);
    the verifier's ``answer_reward``/``format_reward`` are left as they are."""
    if not cost:
        return scores
    out = []
    for s, r in zip(scores, rollouts_):
        penalty = cost * r.info.get("tool_calls", 0)
        out.append({**s, "reward": s["reward"] - penalty, "tool_cost": penalty})
    return out


def loss_mask_tensor(prompt_lengths: Sequence[int], loss_masks: Sequence[list[bool] | None],
                     shape: tuple[int, int]) -> torch.Tensor:
    """(batch, seq) bool in label positions (``core.build_sequences``'s shifted layout): False on
    observation tokens, True on the model's tokens; a row whose mask is None (a single-turn
    rollout) is True from its first response position on. AND it into ``response_mask`` (which
    also removes prompt and padding positions), so observation tokens leave every loss, advantage
    and length normaliser."""
    out = torch.zeros(shape, dtype=torch.bool)
    for i, (n_prompt, mask) in enumerate(zip(prompt_lengths, loss_masks)):
        if mask is None:
            out[i, n_prompt - 1:] = True
            continue
        values = torch.tensor(mask, dtype=torch.bool)[: shape[1] - (n_prompt - 1)]
        out[i, n_prompt - 1: n_prompt - 1 + len(values)] = values
    return out
