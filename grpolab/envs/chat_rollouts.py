"""Multi-turn rollouts with native function calling (``env: {tool_format: chat_template}``).

The model writes a turn in its own syntax until its end of turn; the turn's tool calls are parsed
(``chat_tools.parse_tool_calls``), run, and their results appended as ``tool`` messages through
the chat template, then the model continues — up to ``max_turns`` turns and ``max_total_tokens``
tokens after the prompt. A turn without a call ends the rollout: it is the answer. A call the model
could not read the result of (in the last allowed turn, or whose results leave no room to answer) is
not run and gets no ``tool`` message, as verifiers ends a rollout before its ``env_response``.

Exactness and masks are those of the tag format (``rollouts.py``): the trained ids are the
sampled ids; the appended ids (``ChatRenderer.continuation``) are tokenised once and masked out
of every loss. A tool's result cannot fake a turn: the text of the tokenizer's special tokens
(``<|im_end|>``, ``<|im_start|>``, ...) is removed from it before it is rendered.

Per rollout, ``info`` counts ``tool_calls``, ``tool_errors``, ``malformed_calls`` and
``template_mismatches``; ``Rollout.messages`` is the conversation after the prompt in OpenAI's format
(assistant turns with their ``tool_calls``, arguments as JSON text; ``tool`` results with their
``tool_call_id``), for rewards that read messages (a verifiers rubric).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..rollout import Rollout, SamplingParams
from .chat_tools import CallRequest, ChatRenderer, FunctionTools, class_methods, parse_tool_calls
from .rollouts import _continue, _tokenizer_of, _Trace, _turn_sampling


@dataclass
class ChatToolEnv:
    """Tools in the model's own function-calling format, and the limits of a rollout.

    ``functions``: name -> callable taking the schema's arguments (run in a thread with
    ``tool_timeout_s``); ``process_tools``: name -> a ``CustomTool`` run in a supervised worker
    process (``module:function`` tools); ``classes``: TRL-style classes, one instance per rollout,
    whose public methods are tools; ``renderer``: the template with every schema; ``per_rollout``: tools
    made for each rollout from its prompt (``vf_v1_tools.V1Tools``: a verifiers.v1 task's toolsets)."""

    renderer: ChatRenderer
    functions: dict[str, Callable] = field(default_factory=dict)
    process_tools: dict[str, Any] = field(default_factory=dict)
    classes: list[type] = field(default_factory=list)
    max_turns: int = 4
    max_total_tokens: int = 256
    call_cost: float = 0.0
    max_observation_chars: int = 2000
    max_observation_tokens: int | None = None
    tool_timeout_s: float = 10.0
    per_rollout: Any = None
    _pool: cf.ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    def bind(self, template) -> None:
        """Render the run's prompts with this environment's tool schemas (a chat template's ``use_tools``)."""
        if callable(getattr(template, "use_tools", None)):
            template.use_tools(self.renderer.schemas, self.renderer.chat_template)
        if self.per_rollout is not None:  # it finds each prompt's task by the template's rendered texts
            self.per_rollout.bind(template)

    def rollouts(self, backend, prompts, n, sampling, prompt_ids=None, tokenizer=None) -> list[Rollout]:
        """``chat_rollouts`` in this environment (what ``EnvBackend.generate`` calls)."""
        return chat_rollouts(backend, self, prompts, n, sampling, prompt_ids, tokenizer)

    def stop_strings(self, extra: Sequence[str] = ()) -> list[str]:
        """Only the sampling's own: a chat model's turn ends at its end of turn."""
        return list(dict.fromkeys(extra))

    def tools_for_rollout(self, prompt: str | None = None) -> FunctionTools:
        """This rollout's tools: the shared functions, a fresh instance of each class (``reset()`` first)
        and, with ``per_rollout``, those it makes for ``prompt``."""
        functions = dict(self.functions)
        for cls in self.classes:
            instance = cls()
            if callable(getattr(instance, "reset", None)):
                instance.reset()
            functions.update({name: getattr(instance, name) for name in class_methods(cls)})
        schemas = {s["function"]["name"]: s["function"].get("parameters") for s in self.renderer.schemas}
        if self.per_rollout is not None:
            return self.per_rollout.tools(prompt, functions, self.tool_timeout_s, schemas)
        return FunctionTools(functions, self.tool_timeout_s, schemas)

    def run(self, tools: FunctionTools, calls: Sequence[CallRequest]) -> list:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="grpolab-tool")
        return tools.run(calls, self._pool, self.process_tools)

    def result(self, output, tokenizer) -> tuple[str, bool]:
        """The text of a ``tool`` message (``error: ...`` for a failed call), special-token text removed,
        cut to ``max_observation_chars`` (then ``max_observation_tokens``); and whether it was cut."""
        text = output.text if output.error is None else f"error: {output.error}"
        truncated = len(text) > self.max_observation_chars
        text = _without_special_tokens(text[: self.max_observation_chars], tokenizer)
        if self.max_observation_tokens is not None:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > self.max_observation_tokens:
                text = _without_special_tokens(tokenizer.decode(ids[: self.max_observation_tokens],
                                                                skip_special_tokens=True), tokenizer)
                truncated = True
        return text, truncated


def _observation(t: _ChatTrace, env: ChatToolEnv, tokenizer, sampled: str, content: str, calls, texts):
    """The observation of ``calls`` with results ``texts`` as (text, ids, exact), or None when it
    leaves no room to answer within ``max_total_tokens`` (the trace then ends with "length")."""
    obs_text, exact = env.renderer.continuation(sampled, content, calls, texts)
    obs_ids = tokenizer(obs_text, add_special_tokens=False)["input_ids"]
    if len(t.trace.ids) + len(obs_ids) < env.max_total_tokens:
        return obs_text, obs_ids, exact
    t.trace.finish_reason = "length"
    return None


def _without_special_tokens(text: str, tokenizer) -> str:
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    specials += [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                 if getattr(t, "special", False) and t.content]
    while True:
        before = text
        for token in specials:
            text = text.replace(token, "")
        if text == before:
            return text


@dataclass
class _ChatTrace:
    trace: _Trace
    tools: FunctionTools
    messages: list[dict] = field(default_factory=list)
    malformed: int = 0
    mismatches: int = 0

    def rollout(self) -> Rollout:
        out = self.trace.rollout()
        out.info.update(malformed_calls=self.malformed, template_mismatches=self.mismatches)
        if callable(getattr(self.tools, "rollout_info", None)):  # a verifiers.v1 rollout's state, for its rewards
            out.info.update(self.tools.rollout_info())
        return dataclasses.replace(out, messages=self.messages)


def chat_rollouts(backend, env: ChatToolEnv, prompts: Sequence[str], n: int, sampling: SamplingParams,
                  prompt_ids: Sequence[list[int]] | None = None, tokenizer=None) -> list[Rollout]:
    """``n`` function-calling rollouts per prompt, prompt-major (see the module docstring)."""
    tokenizer = _tokenizer_of(backend, tokenizer)
    first = backend.generate(list(prompts), n, _turn_sampling(sampling, env, 0, env.max_total_tokens),
                             prompt_ids=prompt_ids)
    traces = [_ChatTrace(_Trace(r.prompt, list(r.prompt_ids), r.prompt_index), env.tools_for_rollout(r.prompt))
              for r in first]
    outputs, live = first, list(range(len(traces)))
    for turn in range(env.max_turns):
        pending = []
        for i, out in zip(live, outputs):
            t = traces[i]
            t.trace.add_turn(out)
            content, calls = parse_tool_calls(out.response, tokenizer, env.renderer.schemas)
            if out.finish_reason == "length" or not calls:
                t.messages.append({"role": "assistant", "content": out.response})
                continue
            t.trace.calls += len(calls)
            t.malformed += sum(c.problem is not None for c in calls)
            t.messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": f"call_{turn}_{k}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                for k, c in enumerate(calls) if c.problem is None]})
            pending.append((i, out, content, calls))
        live = []
        for i, out, content, calls in pending:
            t = traces[i]
            # As verifiers' MultiTurnEnv (max_turns / token limit checked before env_response): a call the
            # model can no longer read the result of is not run, and no tool message reaches the rubric.
            if turn + 1 >= env.max_turns:
                continue  # calls in the last turn are not run
            sampled = tokenizer.decode(out.response_ids, skip_special_tokens=False)
            if _observation(t, env, tokenizer, sampled, content, calls, [""] * len(calls)) is None:
                continue  # not even empty results would fit: nothing is run
            results = env.run(t.tools, calls)
            t.trace.errors += sum(r.error is not None for r in results)
            texts, cut = [], 0
            for result in results:
                text, truncated = env.result(result, tokenizer)
                cut += truncated
                texts.append(text)
            observation = _observation(t, env, tokenizer, sampled, content, calls, texts)
            if observation is None:
                continue  # the results do not fit: the model never reads them
            obs_text, obs_ids, exact = observation
            t.trace.truncated += cut
            t.mismatches += not exact
            t.messages.extend({"role": "tool", "tool_call_id": f"call_{turn}_{k}", "name": call.name or "error",
                               "content": text} for k, (call, text) in enumerate(zip(calls, texts)))
            t.trace.add_observation(obs_text, obs_ids)
            live.append(i)
        if not live:
            break
        contexts = [traces[i].trace.prompt_ids + traces[i].trace.ids for i in live]
        budgets = [env.max_total_tokens - len(traces[i].trace.ids) for i in live]
        outputs = _continue(backend, tokenizer, [traces[i].trace.prompt for i in live], contexts, sampling, env,
                            turn + 1, budgets)
    return [t.rollout() for t in traces]
