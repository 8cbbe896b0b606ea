"""Datasets: JSONL with configurable fields, GSM8K, MATH, SFT pairs, preference triples, and
Hugging Face ``datasets`` names.

Bad input never passes silently: an invalid JSON line, a missing or empty field, or a non-UTF-8
byte raises ``DataError`` naming ``file:line`` and the problem; with ``on_error="skip"`` the line
is skipped, counted in ``.skipped`` of the returned list, and reported in one warning. A missing
file, a directory, or a file that yields no record at all is one ``DataError`` naming the path.

Every record read from a file says where it came from, ``"path:line"``: ``Example.meta["source"]``,
``SFTPair.source``, ``PreferencePair.source`` (embedded tasks use ``"task:NAME:split:index"``).
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..rewards.verifiers import last_boxed


class DataError(ValueError):
    """Malformed data; the message names the file and line."""


@dataclass
class Example:
    """A question with its ground truth; ``solution`` is a worked response for SFT (optional).
    ``question`` is text, or a conversation (a list of ``{role, content}`` messages, TRL's
    conversational format), which only a chat template can render."""

    question: str | list[dict]
    answer: Any
    solution: str | None = None
    meta: dict = field(default_factory=dict)


@dataclass
class SFTPair:
    """A prompt (text, or a conversation rendered by the chat template) and the response to
    imitate; or ``messages``, a whole conversation whose assistant turns are imitated."""

    prompt: str | list[dict]
    response: str | None
    ground_truth: Any = None
    source: str | None = None  # "path:line" when read from a file
    messages: list[dict] | None = None


@dataclass
class PreferencePair:
    prompt: str | list[dict]  # text, or a conversation (rendered by the chat template)
    chosen: str
    rejected: str
    source: str | None = None  # "path:line" when read from a file
    # the raw question behind a formatted ``prompt`` (task pairs): what a reward model with
    # ``chat_template: true`` reads as the user message, in training as in scoring
    question: str | list[dict] | None = None


class Loaded(list):
    """A list of records plus ``skipped``: the ``file:line: problem`` of each skipped line."""

    def __init__(self, items=(), skipped=None):
        super().__init__(items)
        self.skipped: list[str] = list(skipped or [])


def _iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    """Yield (line number, parsed object or None, problem or None) for each non-blank line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a data file")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield lineno, None, f"not valid UTF-8 (byte {exc.start})"
                continue
            if not text.strip():
                continue
            try:
                yield lineno, json.loads(text), None
            except json.JSONDecodeError as exc:
                yield lineno, None, f"invalid JSON ({exc.msg} at column {exc.colno})"


def require_field(obj: Any, name: str) -> Any:
    """``obj[name]`` of a JSON object; KeyError with the problem when ``obj`` is not an object or
    the field is missing, null or blank (``read_jsonl_records`` turns it into ``file:line: problem``)."""
    if not isinstance(obj, dict):
        raise KeyError(f"line is a JSON {type(obj).__name__}, not an object")
    if name not in obj:
        raise KeyError(f"missing field {name!r}")
    value = obj[name]
    if value is None or (isinstance(value, str) and not value.strip()):
        raise KeyError(f"empty field {name!r}")
    return value


def conversation(value: Any, name: str) -> list[dict]:
    """``value`` checked as a list of ``{role, content}`` messages (roles system/user/assistant/tool,
    content text; an assistant turn's OpenAI ``tool_calls`` kept, its content then optional); KeyError
    naming the field and the first bad message otherwise."""
    if not isinstance(value, list) or not value:
        raise KeyError(f"field {name!r} must be text or a non-empty list of {{role, content}} messages")
    out = []
    for i, m in enumerate(value):
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if calls is not None and not (isinstance(calls, list) and calls):
            raise KeyError(f"field {name!r}: message {i}'s tool_calls must be a non-empty list of calls")
        if calls and m.get("content") is None:  # OpenAI's form: a turn of calls alone has no content
            m = {**m, "content": ""}
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise KeyError(f"field {name!r}: message {i} is not a {{role, content}} object")
        if m["role"] not in ("system", "user", "assistant", "tool") or not isinstance(m["content"], str):
            raise KeyError(f"field {name!r}: message {i} needs a role (system/user/assistant/tool) and text content")
        out.append({"role": m["role"], "content": m["content"], **({"tool_calls": calls} if calls else {})})
    return out


def text_or_conversation(obj: Any, name: str) -> str | list[dict]:
    """A field holding text or a conversation (TRL's conversational format); a conversation
    prompt needs a user message (a system message alone asks nothing)."""
    value = require_field(obj, name)
    if isinstance(value, dict):
        raise KeyError(f"field {name!r} is one message object; a conversation is a list of them: "
                       '[{"role": ..., "content": ...}]')
    if isinstance(value, bool):  # true/false asks nothing (a number may be a question: "12")
        raise KeyError(f"field {name!r} is {str(value).lower()}; expected text or a list of messages")
    return prompt_conversation(value, name) if isinstance(value, list) else str(value)


def prompt_conversation(value: Any, name: str) -> list[dict]:
    """``conversation(value, name)`` that has a user message to answer."""
    messages = conversation(value, name)
    if not any(m["role"] == "user" for m in messages):
        raise KeyError(f"field {name!r} has no user message")
    return messages


def assistant_text(obj: Any, name: str) -> str:
    """A response field: text, or a conversation whose assistant messages are the response
    (TRL's conversational ``completion``/``chosen``/``rejected``)."""
    value = require_field(obj, name)
    if not isinstance(value, list):
        return str(value)
    turns = [m["content"] for m in conversation(value, name) if m["role"] == "assistant"]
    if not turns:
        raise KeyError(f"field {name!r} has no assistant message")
    if not "".join(turns).strip():
        raise KeyError(f"empty field {name!r} (its assistant messages are blank)")
    return "".join(turns)


def prompt_messages(messages: list[dict], name: str = "messages") -> list[dict]:
    """A conversation's prompt: up to its last user message (a final assistant answer left out)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise KeyError(f"field {name!r} has no user message")
    return messages[: last_user + 1]


def _stamp_source(record: Any, where: str) -> Any:
    """Record ``where`` in ``record.meta["source"]`` or ``record.source`` when it has one and it is unset."""
    if isinstance(getattr(record, "meta", None), dict):
        record.meta.setdefault("source", where)
    elif hasattr(record, "source") and record.source is None:
        record.source = where
    return record


def _no_records_error(path: str | Path, skipped: list[str]) -> DataError:
    if not skipped:
        what = "is empty" if Path(path).stat().st_size == 0 else "has only blank lines"
        return DataError(f"{path}: no examples (the file {what})")
    first = skipped[0].removeprefix(f"{path}:")
    n = len(skipped)
    lines = "the 1 line was" if n == 1 else f"all {n} lines were"
    return DataError(f"{path}: no examples ({lines} skipped: first problem at line {first})")


def read_jsonl_records(path: str | Path, convert, on_error: str = "raise") -> Loaded:
    """Read ``path`` and map each object through ``convert(obj)``; ``convert`` raises KeyError or
    ValueError with the problem. Errors name ``file:line``; a file that yields no record is an
    error. A record with a ``meta`` dict or a ``source`` field is stamped with ``"path:line"``."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    out = Loaded()
    for lineno, obj, problem in _iter_jsonl(path):
        if problem is None:
            try:
                out.append(_stamp_source(convert(obj), f"{path}:{lineno}"))
                continue
            except (KeyError, ValueError, TypeError) as exc:
                problem = exc.args[0] if exc.args else str(exc)
        where = f"{path}:{lineno}: {problem}"
        if on_error == "raise":
            raise DataError(where)
        out.skipped.append(where)
    if not out:
        raise _no_records_error(path, out.skipped)
    if out.skipped:
        warnings.warn(f"{path}: skipped {len(out.skipped)} malformed line(s); first: {out.skipped[0]}", stacklevel=2)
    return out


def load_jsonl(
    path: str | Path,
    question_field: str = "question",
    answer_field: str | None = "answer",
    solution_field: str | None = None,
    on_error: str = "raise",
) -> Loaded:
    """Examples from a JSONL file with the named fields (answers kept as given: str, number or list).
    The question may be a conversation (TRL's format): the question field, or — when the file has
    none — a ``prompt`` or ``messages`` field holding a list of ``{role, content}`` messages."""

    def convert(obj):
        solution = require_field(obj, solution_field) if solution_field else None
        if isinstance(obj, dict) and question_field not in obj and ("prompt" in obj or "messages" in obj):
            question = (text_or_conversation(obj, "prompt") if "prompt" in obj
                        else prompt_messages(conversation(require_field(obj, "messages"), "messages")))
        else:
            question = text_or_conversation(obj, question_field)
        answer = require_field(obj, answer_field) if answer_field is not None else None  # None: prompts only
        return Example(question, answer, solution)

    examples = read_jsonl_records(path, convert, on_error)
    warn_mixed_questions(path, examples)
    return examples


def warn_mixed_questions(path: str | Path, examples: list[Example]) -> None:
    """One warning when a file holds both text questions and conversations. Each is rendered as
    TRL renders a row (a conversation by the chat template as it is, text by the prompt template),
    so under the default template only the text ones get its instruction and prefill."""
    text = next((e for e in examples if isinstance(e.question, str)), None)
    convo = next((e for e in examples if isinstance(e.question, list)), None)
    if text is not None and convo is not None:
        lines = [e.meta.get("source", "?").rsplit(":", 1)[-1] for e in (text, convo)]
        warnings.warn(f"{path}: mixes text questions (first at line {lines[0]}) and conversations (first at line "
                      f"{lines[1]}): a text question is formatted by the prompt template, a conversation is rendered "
                      "as it is unless prompt_template names a preset; use one kind for prompts of one form",
                      stacklevel=3)


def gsm8k_final_answer(solution: str) -> str:
    """The final answer after ``####`` with thousands separators removed."""
    if "####" not in solution:
        raise ValueError("no '####' final answer in the solution")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").strip()
    if not answer:
        raise ValueError("empty final answer after '####'")
    return answer


def gsm8k_reasoning(solution: str) -> str:
    """The worked solution before ``####``, without the ``<<calc>>`` annotations."""
    return re.sub(r"<<[^>]*>>", "", solution.rsplit("####", 1)[0]).strip()


def load_gsm8k(path: str | Path, on_error: str = "raise") -> Loaded:
    """GSM8K JSONL (``question``, ``answer`` with ``#### N``): answer = N; solution = the reasoning
    in R1-Zero form (``reasoning</think> <answer>N</answer>``)."""

    def convert(obj):
        solution = str(require_field(obj, "answer"))
        final = gsm8k_final_answer(solution)
        response = f"{gsm8k_reasoning(solution)}</think> <answer>{final}</answer>"
        return Example(str(require_field(obj, "question")), final, response)

    return read_jsonl_records(path, convert, on_error)


def last_boxed_answer(solution: str) -> str:
    answer = last_boxed(solution)
    if answer is None or not answer.strip():
        raise ValueError("no \\boxed{...} answer in the solution")
    return answer.strip()


def load_math(path: str | Path, question_field: str = "problem", solution_field: str = "solution",
              on_error: str = "raise") -> Loaded:
    """MATH JSONL (``problem``, ``solution``): answer = the last ``\\boxed{...}`` (nested braces handled).
    A record that already has an ``answer`` field keeps it."""

    def convert(obj):
        solution = str(require_field(obj, solution_field))
        answer = (obj.get("answer")
                  if isinstance(obj, dict) and obj.get("answer") not in (None, "")
                  else last_boxed_answer(solution))
        response = f"{solution.strip()}</think> <answer>{answer}</answer>"
        return Example(str(require_field(obj, question_field)), answer, response)

    return read_jsonl_records(path, convert, on_error)


def load_sft_pairs(path: str | Path, prompt_field: str = "prompt", response_field: str = "response",
                   on_error: str = "raise") -> Loaded:
    """SFT pairs ``{"prompt", "response"}`` (CS336 ``sft.jsonl``) — or TRL's formats:
    ``{"prompt", "completion"}`` and ``{"messages"}`` (a whole conversation, its assistant turns
    imitated). A prompt may be a conversation (a list of ``{role, content}``), a completion a list
    of assistant messages. An optional ``ground_truth`` is kept."""

    def convert(obj):
        gt = obj.get("ground_truth") if isinstance(obj, dict) else None
        if isinstance(obj, dict) and "messages" in obj and prompt_field not in obj:
            messages = conversation(require_field(obj, "messages"), "messages")
            if not any(m["role"] == "assistant" for m in messages):
                raise KeyError("field 'messages' has no assistant message to imitate")
            blank = next((i for i, m in enumerate(messages)
                          if m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls")), None)
            if blank is not None:
                raise KeyError(f"field 'messages': message {blank} is an empty assistant turn (nothing to imitate)")
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            return SFTPair(messages[:first], None, gt, messages=messages)
        response = response_field if not (isinstance(obj, dict) and response_field not in obj and "completion" in obj) \
            else "completion"
        return SFTPair(text_or_conversation(obj, prompt_field), assistant_text(obj, response), gt)

    return read_jsonl_records(path, convert, on_error)


def load_preferences(path: str | Path, on_error: str = "raise") -> Loaded:
    """Preference triples ``{"prompt", "chosen", "rejected"}``; the prompt may be a conversation and
    chosen/rejected lists of assistant messages (TRL's conversational preference format)."""

    def convert(obj):
        return PreferencePair(text_or_conversation(obj, "prompt"), assistant_text(obj, "chosen"),
                              assistant_text(obj, "rejected"))

    return read_jsonl_records(path, convert, on_error)
