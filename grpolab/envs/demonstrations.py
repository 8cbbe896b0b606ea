"""Tool-using demonstrations for SFT, replayed through the live environment, and the figures of a
batch of multi-turn rollouts.

A worked demonstration is text such as
``<search>Zorvania capital</search><result>...</result></think> <answer>Velmora</answer>``. Its
observations are not trusted: each call is run again through the environment's tool and the
observation is replaced by what the tool returns now (its index, ``top_k`` and truncation), so SFT
shows the model exactly the observations it will read during rollouts. Segments are tokenised
the way rollouts build them — each model turn and each observation on its own — and the
observation tokens get ``loss_mask`` False, as in a multi-turn rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..rollout import Rollout
from .base import ToolCall, ToolEnv


@dataclass
class Demonstration:
    """A replayed demonstration: prompt ids, response ids (model segments and observations), the
    per-token loss mask (False on observations), the response text and its number of tool calls."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[bool]
    text: str
    tool_calls: int


def split_demonstration(env: ToolEnv, solution: str) -> tuple[list[str], list[ToolCall]]:
    """The model segments of ``solution`` and the calls between them (``len(segments) ==
    len(calls) + 1``); an observation written after a call (``<result>...</result>`` and the
    suffix) is dropped, to be replaced by the live tool's."""
    segments, calls = [], []
    rest = solution
    opener, closer = f"<{env.result_tag}>", f"</{env.result_tag}>"
    while True:
        ends = [(rest.find(c), c) for c in env.stop_strings() if c != env.answer_stop and rest.find(c) >= 0]
        if not ends:
            segments.append(rest)
            return segments, calls
        pos, tag = min(ends)
        segment, rest = rest[: pos + len(tag)], rest[pos + len(tag):]
        segments.append(segment)
        calls.append(env.parse_call(segment))
        if rest.startswith(opener) and closer in rest:
            rest = rest[rest.index(closer) + len(closer):]
            if env.observation_suffix and rest.startswith(env.observation_suffix):
                rest = rest[len(env.observation_suffix):]


def replay_demonstrations(env: ToolEnv, tokenizer, prompts: Sequence[str],
                          solutions: Sequence[str]) -> list[Demonstration]:
    """Each (prompt, solution) with live observations (see the module docstring); all calls run in
    one batch per tool."""
    if len(prompts) != len(solutions):
        raise ValueError(f"got {len(prompts)} prompts but {len(solutions)} solutions")
    split = [split_demonstration(env, s) for s in solutions]
    flat = [c for _, calls in split for c in calls]
    observations = iter([env.observation(o, tokenizer) for o in env.run_calls(flat)] if flat else [])
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    out = []
    for p_ids, (segments, calls) in zip(prompt_ids, split):
        ids, mask, text = [], [], ""
        for k, segment in enumerate(segments):
            if segment:
                seg_ids = tokenizer(segment, add_special_tokens=False)["input_ids"]
                ids, mask, text = ids + seg_ids, mask + [True] * len(seg_ids), text + segment
            if k < len(calls):
                obs = next(observations)
                obs_ids = tokenizer(obs, add_special_tokens=False)["input_ids"]
                ids, mask, text = ids + obs_ids, mask + [False] * len(obs_ids), text + obs
        out.append(Demonstration(list(p_ids), ids, mask, text, len(calls)))
    return out


def tool_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Per-rollout means of a batch of multi-turn rollouts: tool calls, tool errors, turns,
    observation and model tokens, the observation share of all response tokens, the share
    of rollouts that called a tool at least once (``tools/call_rate``), and the number of
    observations cut to the environment's cap (``tools/truncated_observations``)."""
    n = max(1, len(rollouts))
    info = [r.info or {} for r in rollouts]

    def mean(key: str) -> float:
        return sum(i.get(key, 0) for i in info) / n

    obs, model = mean("observation_tokens"), mean("model_tokens")
    return {
        "tools/calls_per_rollout": mean("tool_calls"),
        "tools/errors_per_rollout": mean("tool_errors"),
        "tools/turns": mean("turns"),
        "tools/observation_tokens": obs,
        "tools/model_tokens": model,
        "tools/observation_token_share": obs / (obs + model) if obs + model else 0.0,
        "tools/call_rate": sum(i.get("tool_calls", 0) > 0 for i in info) / n,
        # observations cut at max_observation_chars/_tokens in this batch (a count, not a mean)
        "tools/truncated_observations": sum(i.get("truncated_observations", 0) for i in info),
        # native function calling (counts): calls that were not a valid call, and turns the template
        # re-renders differently from what was sampled (the sampled ids were kept)
        "tools/malformed_calls": sum(i.get("malformed_calls", 0) for i in info),
        "tools/template_mismatches": sum(i.get("template_mismatches", 0) for i in info),
    }
