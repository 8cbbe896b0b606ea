"""Tool-using demonstrations for SFT, replayed through the live environment, and the figures of a
batch of multi-turn rollouts.

A worked demonstration is text such as
``<search>Zorvania capital</search><result>...</result></think> <answer>Velmora</answer>``. Its
observations are not trusted: each call is run again through the environment's tool and the
observation is replaced by what the tool returns now (its index, ``top_k`` and truncation), so SFT
shows the model exactly the observations it will read during rollouts. Segments are tokenised
the way rollouts build them — each model turn and each observation on its own — and the
observation tokens get ``loss_mask`` False, as in a multi-turn rollout.

In the model's own function-calling format (``env: {tool_format: chat_template}``),
``replay_chat_demonstrations`` does the same with the chat template: the assistant turns are what
the sampler writes, the calls are parsed as ``chat_rollouts`` parses them, and the template's
continuation (``ChatRenderer.continuation``: glue, ``tool`` messages, next generation prompt) is
appended masked — the ids and mask of a rollout that wrote the same turns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..rollout import Rollout
from .base import ToolCall, ToolEnv
from .chat_rollouts import ChatToolEnv
from .chat_tools import CallRequest, _call_from, argument_problem, parse_tool_calls


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


# --- native function calling (``tool_format: chat_template``) ---------------------------------------


def chat_turn_text(env: ChatToolEnv, tokenizer, history: list[dict], message: dict) -> str:
    """What the model writes for the assistant ``message`` after ``history``: the template's
    rendering of the turn, up to and including the tokenizer's end-of-turn (eos) token, where the
    sampler stops; the rest of the template's end of turn is glue the sampler does not write."""
    renderer = env.renderer
    base, ref = renderer.render(history, True), renderer.render(history + [message])
    if not ref.startswith(base):
        raise ValueError("the chat template renders an assistant turn that does not continue the prompt")
    turn, end, eos = ref[len(base):], renderer._end_of_turn, tokenizer.eos_token or ""
    if end and turn.endswith(end):
        turn = turn[: len(turn) - len(end)] + (end[: end.index(eos) + len(eos)] if eos and eos in end else "")
    return turn


def _message_call(entry: Any) -> CallRequest:
    function = entry.get("function", entry) if isinstance(entry, dict) else entry
    return _call_from(function)


def _bad_call(env: ChatToolEnv, call: CallRequest) -> str | None:
    """Why a demonstration's call is not one the environment's tools accept, or None."""
    if call.problem is not None:
        return call.problem
    schemas = {s["function"]["name"]: s["function"].get("parameters") for s in env.renderer.schemas}
    if call.name not in schemas:
        return f"calls {call.name!r}, which is not one of the tools ({', '.join(schemas)})"
    problem = argument_problem(call.arguments, schemas[call.name])
    return None if problem is None else f"{call.name}: {problem}"


def _turn_texts(env: ChatToolEnv, tokenizer, prompt: str | list[dict], response: str | list[dict],
                where: str) -> tuple[str, list[str | dict]]:
    """(the prompt's text, the assistant turns: a message to render, or a worked turn's text with its eos)."""
    if isinstance(prompt, list):
        prompt_text = env.renderer.render(prompt, True)
    else:
        prompt_text = prompt
        missing = [s["function"]["name"] for s in env.renderer.schemas if s["function"]["name"] not in prompt]
        if missing:
            raise ValueError(f"{where}: the prompt does not show the tools ({', '.join(missing)}): give {{messages}} "
                             "conversations, or questions the run's chat template formats")
    if isinstance(response, str):  # a worked solution in the model's syntax: turns end at the eos text
        eos = tokenizer.eos_token or ""
        pieces = response.split(eos) if eos else [response]
        if eos and pieces[-1].strip() == "":
            pieces = pieces[:-1]
        return prompt_text, [p + eos for p in pieces]
    turns = []
    for m in response:
        role = m.get("role") if isinstance(m, dict) else None
        if role == "assistant":
            turns.append(m)
        elif role != "tool":  # a tool message's content is replaced by the live tool's
            raise ValueError(f"{where}: a {role!r} message after the first assistant turn: a tool demonstration "
                             "continues with assistant turns and tool results only")
    return prompt_text, turns


def replay_chat_demonstrations(env: ChatToolEnv, tokenizer, prompts: Sequence[str | list[dict]],
                               responses: Sequence[str | list[dict]],
                               sources: Sequence[str | None] | None = None) -> list[Demonstration]:
    """Tool demonstrations in the model's own function-calling format, replayed through the live
    tools and tokenised as ``chat_rollouts`` builds a rollout that wrote the same turns.

    A demonstration is a prompt (rendered text, or messages the template renders with the tools) and
    its response: the messages after the prompt (assistant turns, their ``tool_calls``; ``tool``
    messages are replaced by the live results), or a worked solution in the model's syntax whose
    turns end with the eos text (``<tool_call>{...}</tool_call><|im_end|>42<|im_end|>``). Each
    assistant turn is what the sampler writes (``chat_turn_text``: up to its eos, trained); its calls
    are parsed from that text as a rollout parses them, run with one fresh ``tools_for_rollout`` per
    demonstration, and the template's continuation (end-of-turn glue, ``tool`` messages, next
    generation prompt) is appended with ``loss_mask`` False. A call that does not parse, names no tool
    or misfits its schema, a failing call, a last turn with calls or more turns than ``max_turns`` is
    one line naming the demonstration (``sources[i]``, e.g. ``file:line``)."""
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    out = []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        where = (sources[i] if sources is not None and sources[i] else None) or f"demonstration {i}"
        prompt_text, turns = _turn_texts(env, tokenizer, prompt, response, where)
        if not turns:
            raise ValueError(f"{where}: no assistant turn to imitate")
        if len(turns) > env.max_turns:
            raise ValueError(f"{where}: {len(turns)} assistant turns, more than env.max_turns ({env.max_turns})")
        history = list(prompt) if isinstance(prompt, list) else None
        tools, ids, mask, text, n_calls = env.tools_for_rollout(), [], [], "", 0
        for k, turn in enumerate(turns):
            at = f"{where}: assistant turn {k + 1}"
            if isinstance(turn, dict):
                wanted = [_message_call(c) for c in turn.get("tool_calls") or []]
                for call in wanted:
                    if (problem := _bad_call(env, call)) is not None:
                        raise ValueError(f"{at}: {problem}")
                rendered = {"role": "assistant", "content": turn.get("content") or "",
                            "tool_calls": [c.message() for c in wanted]}
                if not wanted:
                    rendered.pop("tool_calls")
                turn = chat_turn_text(env, tokenizer, history or [{"role": "user", "content": "Q"}], rendered)
            turn_ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
            ids, mask, text = ids + turn_ids, mask + [True] * len(turn_ids), text + turn
            # the rollout's reading of the same ids (chat_rollouts: parse_tool_calls on the response text)
            content, calls = parse_tool_calls(tokenizer.decode(turn_ids, skip_special_tokens=True), tokenizer,
                                              env.renderer.schemas)
            if not calls:
                if history is not None:
                    history.append({"role": "assistant", "content": content})
                continue
            if k + 1 == len(turns):
                raise ValueError(f"{at}: the last turn calls a tool; a demonstration ends with the answer")
            for call in calls:
                if (problem := _bad_call(env, call)) is not None:
                    raise ValueError(f"{at}: {problem}")
            results = env.run(tools, calls)
            failed = [(c, r) for c, r in zip(calls, results) if r.error is not None]
            if failed:
                call, result = failed[0]
                raise ValueError(f"{at}: the call {call.name}({json.dumps(call.arguments)}) failed: {result.error}")
            texts = [env.result(r, tokenizer)[0] for r in results]
            sampled = tokenizer.decode(turn_ids, skip_special_tokens=False)
            obs_text, _ = env.renderer.continuation(sampled, content, calls, texts)
            obs_ids = tokenizer(obs_text, add_special_tokens=False)["input_ids"]
            ids, mask, text = ids + obs_ids, mask + [False] * len(obs_ids), text + obs_text
            n_calls += len(calls)
            if history is not None:
                history += [{"role": "assistant", "content": content, "tool_calls": [c.message() for c in calls]},
                            *({"role": "tool", "name": c.name, "content": t} for c, t in zip(calls, texts))]
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        out.append(Demonstration(list(prompt_ids), ids, mask, text, n_calls))
    return out
