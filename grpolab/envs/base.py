"""The tool environment: which tools a model may call, how a call is written and parsed, how the
tool's output comes back as an observation, and the limits of one multi-turn rollout.

A call is written as the tool's tag around its argument, ``<search>Zorvania capital</search>``;
the closing tag is a stop string, so the model's turn ends exactly where the call does. The
observation is the tool's output inside the environment's own tag (``<result>...</result>``),
followed by ``observation_suffix`` (whatever text makes the model continue; empty by default).
Tags in a tool's output are removed before it is wrapped, to a fixed point (``</res<x>ult>`` loses
``<x>`` and then the ``</result>`` it formed): a retrieved passage or a custom tool cannot close the
observation early or fake a call. (The verifier never reads observations anyway: it scores
``Rollout.scored_response``, the model's own turns.) A tool's text is cut to
``max_observation_chars`` before anything else reads it (and to ``max_observation_tokens`` when a
tokenizer is at hand), so a 50 MB tool output is never regex-processed or tokenised whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

_TAG_RE = re.compile(r"</?[A-Za-z_][A-Za-z0-9_\-]*>")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def strip_tags(text: str) -> str:
    """``text`` without any ``<tag>``/``</tag>``, removed until none is left: removing one tag can
    join the pieces around it into another (``<ans<x>wer>``), so one pass is not enough. Each pass
    removes at least one tag, so the loop ends (on a capped observation: milliseconds)."""
    while True:
        stripped = _TAG_RE.sub("", text)
        if stripped == text:
            return text
        text = stripped


@dataclass
class ToolOutput:
    """One call's result: the text the model will see, or an error message (the call failed)."""

    text: str
    error: str | None = None


class Tool(Protocol):
    """What the environment calls. ``name`` is the tag the model writes (``search`` for
    ``<search>...</search>``); ``run`` takes every call of one turn at once (one batch per turn, so a
    retriever scores all queries together and a worker process gets one message) and returns one
    ``ToolOutput`` per query, never raising for a bad query."""

    name: str

    def run(self, queries: Sequence[str]) -> list[ToolOutput]: ...


@dataclass
class ToolCall:
    """A parsed call: the tool's name and its argument (``None`` name: a closing tag with no tool
    behind it, or no opening tag — a malformed call, answered with an error observation)."""

    tool: str | None
    query: str
    problem: str | None = None


@dataclass
class ToolEnv:
    """Tools and limits of multi-turn rollouts (``grpolab.envs.rollouts``).

    ``max_turns``: model turns per rollout (a call in the last turn gets no observation);
    ``max_total_tokens``: model + observation tokens after the prompt; ``call_cost``: subtracted
    from the reward per tool call (``apply_call_cost``); ``answer_stop``: the stop string that ends
    an answer (kept with the sampling's own stop strings); ``max_observation_chars`` /
    ``max_observation_tokens``: the most of one call's output the model reads (cut and counted in
    ``truncated_observations``; ``None``: no token cap).
    """

    tools: dict[str, Tool]
    max_turns: int = 4
    max_total_tokens: int = 256
    call_cost: float = 0.0
    result_tag: str = "result"
    observation_suffix: str = ""
    answer_stop: str = "</answer>"
    max_query_chars: int = 500
    max_observation_chars: int = 2000
    max_observation_tokens: int | None = None
    _closers: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.tools, (list, tuple)):
            self.tools = {t.name: t for t in self.tools}
        if not self.tools:
            raise ValueError("a tool environment needs at least one tool")
        for name in list(self.tools) + [self.result_tag]:
            if not _NAME_RE.match(name):
                raise ValueError(f"tool name {name!r}: letters, digits, '_' and '-' only (it is written as <{name}>)")
        if self.result_tag in self.tools:
            raise ValueError(f"result_tag {self.result_tag!r} is also a tool's name")
        if self.max_turns < 1 or self.max_total_tokens < 1:
            raise ValueError(f"max_turns ({self.max_turns}) and max_total_tokens ({self.max_total_tokens}) "
                             "must be >= 1")
        tokens = self.max_observation_tokens
        if self.max_observation_chars < 1 or (tokens is not None and tokens < 1):
            raise ValueError(f"max_observation_chars ({self.max_observation_chars}) and max_observation_tokens "
                             f"({self.max_observation_tokens}) must be >= 1")
        self._closers = {f"</{name}>": name for name in self.tools}

    def stop_strings(self, extra: Sequence[str] = ()) -> list[str]:
        """The tool-call closers, the answer stop and ``extra`` (the sampling's own), without repeats."""
        out: list[str] = []
        for s in [*self._closers, self.answer_stop, *extra]:
            if s and s not in out:
                out.append(s)
        return out

    def parse_call(self, turn_text: str) -> ToolCall | None:
        """The call a turn ends with, or None when the turn does not end with a tool's closing tag
        (an answer, eos, or the token budget). The argument is the text after the last opening tag
        of that tool in the same turn, stripped."""
        text = turn_text.rstrip()
        for closer, name in self._closers.items():
            if text.endswith(closer):
                body = text[: -len(closer)]
                opener = f"<{name}>"
                start = body.rfind(opener)
                if start < 0:
                    return ToolCall(None, "", f"{closer} without {opener}")
                query = body[start + len(opener):].strip()
                if not query:
                    return ToolCall(name, "", f"empty <{name}> call")
                if len(query) > self.max_query_chars:
                    return ToolCall(name, query, f"query longer than {self.max_query_chars} characters")
                return ToolCall(name, query)
        return None

    def observation(self, output: ToolOutput, tokenizer=None) -> str:
        """The text inserted after a call: ``<result>...</result>`` + ``observation_suffix``; an error
        reads ``<result>error: ...</result>``. See ``render``."""
        return self.render(output, tokenizer)[0]

    def render(self, output: ToolOutput, tokenizer=None) -> tuple[str, bool]:
        """(the observation, whether the tool's text was cut). The text is cut to
        ``max_observation_chars`` first (nothing reads more of it), then its tags are stripped to a
        fixed point, then — with a ``tokenizer`` and ``max_observation_tokens`` — it is cut to that
        many tokens (and stripped again: a decoded cut cannot form a tag either)."""
        body = output.text if output.error is None else f"error: {output.error}"
        if not isinstance(body, str):
            body = str(body)
        truncated = len(body) > self.max_observation_chars
        body = strip_tags(body[: self.max_observation_chars])
        if tokenizer is not None and self.max_observation_tokens is not None:
            ids = tokenizer(body, add_special_tokens=False)["input_ids"]
            if len(ids) > self.max_observation_tokens:
                body = strip_tags(tokenizer.decode(ids[: self.max_observation_tokens], skip_special_tokens=True))
                truncated = True
        return f"<{self.result_tag}>{body}</{self.result_tag}>{self.observation_suffix}", truncated

    def run_calls(self, calls: Sequence[ToolCall]) -> list[ToolOutput]:
        """Every call of a turn: malformed ones answered at once, the rest batched per tool."""
        outputs: list[ToolOutput | None] = [None] * len(calls)
        by_tool: dict[str, list[int]] = {}
        for i, call in enumerate(calls):
            if call.problem is not None or call.tool not in self.tools:
                outputs[i] = ToolOutput("", call.problem or f"unknown tool {call.tool!r}")
            else:
                by_tool.setdefault(call.tool, []).append(i)
        for name, rows in by_tool.items():
            results = self.tools[name].run([calls[i].query for i in rows])
            if len(results) != len(rows):
                raise RuntimeError(f"tool {name!r} returned {len(results)} outputs for {len(rows)} calls")
            for i, out in zip(rows, results):
                outputs[i] = out
        return outputs  # type: ignore[return-value]
