"""The tool environment: which tools a model may call, how a call is written and parsed, how the
tool's output comes back as an observation, and the limits of one multi-turn rollout.

A call is written as the tool's tag around its argument, ``<search>Zorvania capital</search>``;
the closing tag is a stop string, so the model's turn ends exactly where the call does. The
observation is the tool's output inside the environment's own tag (``<result>...</result>``),
followed by ``observation_suffix`` (whatever text makes the model continue; empty by default).
Tags in a tool's output are removed before it is wrapped: a retrieved passage or a custom tool
cannot close the observation early, fake a call, or plant an ``<answer>`` the verifier would read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

_TAG_RE = re.compile(r"</?[A-Za-z_][A-Za-z0-9_\-]*>")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


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
    an answer (kept with the sampling's own stop strings).
    """

    tools: dict[str, Tool]
    max_turns: int = 4
    max_total_tokens: int = 256
    call_cost: float = 0.0
    result_tag: str = "result"
    observation_suffix: str = ""
    answer_stop: str = "</answer>"
    max_query_chars: int = 500
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

    def observation(self, output: ToolOutput) -> str:
        """The text inserted after a call: ``<result>...</result>`` + ``observation_suffix``; an error
        reads ``<result>error: ...</result>``. Tags inside the tool's text are removed."""
        body = output.text if output.error is None else f"error: {output.error}"
        body = _TAG_RE.sub("", body)
        return f"<{self.result_tag}>{body}</{self.result_tag}>{self.observation_suffix}"

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
