"""Native function calling: tools given to a chat model the way it was trained to use them
(``env: {tool_format: chat_template}``).

- **Schemas.** Each tool is an OpenAI function schema: the built-in ``search(query)`` and
  ``calculate(expression)``; a Python function with type hints and a Google-style docstring
  (``"pkg.mod:fn"``; transformers' ``get_json_schema``); or a class (``"pkg.mod:Class"``, TRL's
  ``environment_factory`` form) whose public methods are the tools, one instance per rollout
  (``reset()`` is called first when the class has one; its state lives for that rollout).
- **Rendering.** The tokenizer's own chat template renders the schemas (``tools=``) and the tool
  results (``tool`` messages); ``chat_template: hermes`` puts grpolab's ChatML template with tools
  (Qwen2.5/Hermes format) in place of a template that renders none.
- **Parsing.** A turn's calls are read with the tokenizer's response parser where it has one
  (``response_schema``), else as Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks. A block that is not such JSON, or names no tool, is a failed call: counted
  (``malformed_calls``), answered with an error ``tool`` message, never a crash.
- **Exact ids.** The model's turn is trained as sampled. After a turn with calls, the template
  re-renders the assistant message and the tool results; the ids appended are the text that
  follows the sampled turn in that rendering (the end-of-turn glue, the ``tool`` messages and the
  next generation prompt), tokenised once, masked from every loss. When the re-rendered assistant
  turn differs from the sampled text (a template that reformats the JSON), the sampled ids win and
  the turn is counted in ``template_mismatches``.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..rewards.registry import import_callable
from .base import ToolOutput

# ChatML with tools, in the Hermes/Qwen2.5 format: a system block lists the schemas, calls are
# <tool_call> JSON blocks, results come back as tool turns inside <tool_response>.
HERMES_TEMPLATE = (  # transformers renders with trim_blocks: a newline right after a block tag is written as {{ nl }}
    "{%- set nl = '\\n' %}"
    "{%- if tools %}<|im_start|>system{{ nl }}{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ nl }}"
    "{{ nl }}{% endif %}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>"
    "{{ nl }}{%- elif messages[0].role == 'system' %}<|im_start|>system{{ nl }}{{ messages[0].content }}<|im_end|>"
    "{{ nl }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{{ nl }}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}{% if not loop.first or message.content %}{{ nl }}{% endif %}"
    "<tool_call>{{ nl }}{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "{{ nl }}</tool_call>{%- endfor %}<|im_end|>{{ nl }}"
    "{%- elif message.role == 'tool' %}<|im_start|>tool{{ nl }}<tool_response>{{ nl }}{{ message.content }}{{ nl }}"
    "</tool_response><|im_end|>{{ nl }}"
    "{%- else %}<|im_start|>{{ message.role }}{{ nl }}{{ message.content }}<|im_end|>{{ nl }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant{{ nl }}{%- endif %}"
)
CHAT_TEMPLATES = {"hermes": HERMES_TEMPLATE}

_SENTINEL = "\u2063grpolab-turn\u2063"


def function_schema(fn: Callable, name: str | None = None) -> dict:
    """The OpenAI function schema of ``fn`` (transformers' ``get_json_schema``: type hints and a
    Google-style docstring with ``Args:``); a function it cannot describe is one line naming it."""
    from transformers.utils import get_json_schema

    label = name or getattr(fn, "__name__", repr(fn))
    try:
        variadic = [p.name for p in inspect.signature(fn).parameters.values()
                    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        variadic = []
    if variadic:  # F09: a schema can only name arguments; *args/**kwargs would be described as one named argument
        raise ValueError(f"tool {label!r}: *{variadic[0]} cannot be described as named JSON arguments; give the "
                         "function one named, type-hinted argument per value (a list or a dict for many)")
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 - transformers' parsing errors have several types
        raise ValueError(f"tool {label!r}: no JSON schema can be made of it ({' '.join(str(exc).split())}); a "
                         "function tool needs type hints on every argument and a docstring with an Args: "
                         "section") from None
    if name is not None:
        schema["function"]["name"] = name
    return schema


def _builtin_schema(name: str, param: str, description: str, param_doc: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {param: {"type": "string", "description": param_doc}}, "required": [param]}}}


SEARCH_SCHEMA = _builtin_schema("search", "query", "Search the corpus; returns the best-matching passages.",
                                "What to search for.")
CALCULATE_SCHEMA = _builtin_schema("calculate", "expression", "Evaluate an arithmetic expression (+ - * / // % ** and "
                                   "parentheses).", "The expression, e.g. (3 + 4) * 2.")


@dataclass
class CallRequest:
    """One call the model wrote: the tool's name and its arguments, or the problem that makes it a failed call."""

    name: str | None
    arguments: dict
    problem: str | None = None

    def message(self) -> dict:
        """The call as an OpenAI ``tool_calls`` entry (what the template renders)."""
        return {"type": "function", "function": {"name": self.name or "", "arguments": self.arguments}}


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
# what the JSON decoder raises on input a model can write: a malformed document, nesting past the
# recursion limit (1000 brackets), an integer past Python's 4300-digit conversion limit (ValueError)
_BAD_JSON = (ValueError, RecursionError)


def _loads(text: str) -> tuple[Any, str | None]:
    """(the JSON value of ``text``, None) or (None, why it is not JSON): never raises."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at character {exc.pos}"
    except RecursionError:
        return None, "nested too deep"
    except ValueError as exc:  # an integer of more than 4300 digits
        return None, " ".join(str(exc).split())[:120]


def _decoded_block(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value right after ``<tool_call>`` at ``start`` and the index past its ``</tool_call>``,
    when the block is one JSON value: a ``</tool_call>`` inside a JSON string is part of the value."""
    i = len(text) - len(text[start:].lstrip())
    try:
        obj, end = _DECODER.raw_decode(text, i)
    except _BAD_JSON:
        return None
    j = len(text) - len(text[end:].lstrip())
    return (obj, j + len(_CLOSE)) if text.startswith(_CLOSE, j) else None


def _parse_hermes(text: str) -> tuple[str, list[CallRequest]]:
    calls, pos = [], 0
    while (open_at := text.find(_OPEN, pos)) >= 0:
        body_at = open_at + len(_OPEN)
        decoded = _decoded_block(text, body_at)
        if decoded is not None:
            calls.append(_call_from(decoded[0]))
            pos = decoded[1]
            continue
        close_at = text.find(_CLOSE, body_at)
        if close_at < 0:
            calls.append(CallRequest(None, {}, "unclosed <tool_call>"))
            break
        _, problem = _loads(text[body_at:close_at].strip())
        calls.append(CallRequest(None, {}, f"tool call is not JSON ({problem or 'more than one JSON value'})"))
        pos = close_at + len(_CLOSE)
    start = text.find(_OPEN)
    return (text if start < 0 else text[:start]).strip(), calls


def _call_from(obj: Any) -> CallRequest:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallRequest(None, {}, 'a tool call must be {"name": ..., "arguments": {...}}')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        arguments, _ = _loads(arguments)
    if not isinstance(arguments, dict):
        return CallRequest(obj["name"], {}, "the call's arguments are not a JSON object")
    return CallRequest(obj["name"], arguments)


def parse_tool_calls(text: str, tokenizer=None, schemas: Sequence[dict] = ()) -> tuple[str, list[CallRequest]]:
    """(the turn's text before its calls, its calls): by the tokenizer's response parser when it has
    a ``response_schema``, else as Hermes ``<tool_call>`` JSON blocks. Never raises for what a model wrote."""
    if getattr(tokenizer, "response_schema", None):
        try:
            parsed = tokenizer.parse_response(text, tools=list(schemas) or None)
        except Exception as exc:  # noqa: BLE001 - a parser's failure is a failed call
            return text.strip(), [CallRequest(None, {}, f"the response parser failed ({type(exc).__name__})")]
        calls = [_call_from(c.get("function", c)) for c in parsed.get("tool_calls") or []]
        return str(parsed.get("content") or "").strip(), calls
    return _parse_hermes(text)


class FunctionTools:
    """The tools of one rollout: name -> callable (class tools bound to this rollout's instance), and
    name -> the JSON schema of its parameters (``schemas``: a call's arguments are checked against it)."""

    def __init__(self, functions: dict[str, Callable], timeout_s: float, schemas: dict[str, dict] | None = None):
        self.functions, self.timeout_s, self.schemas = functions, timeout_s, dict(schemas or {})

    def run(self, calls: Sequence[CallRequest], pool: Any, process_tools: dict) -> list[ToolOutput]:
        """One output per call; ``pool`` is unused (each Python call runs in a daemon thread of its own)."""
        outputs: list[ToolOutput] = []
        for call in calls:
            problem = call.problem or argument_problem(call.arguments, self.schemas.get(call.name or ""))
            if problem is not None:
                outputs.append(ToolOutput("", problem))
            elif call.name in process_tools:
                outputs.append(process_tools[call.name].run([call.arguments])[0])
            elif call.name not in self.functions:
                outputs.append(ToolOutput("", f"unknown tool {call.name!r}"))
            else:
                outputs.append(_run_in_thread(self.functions[call.name], call.arguments, self.timeout_s))
        return outputs


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


def _type_problem(value: Any, schema: Any, where: str) -> str | None:
    """Why ``value`` does not fit the JSON schema ``schema`` (its ``type``, ``enum``, ``items``,
    ``anyOf``/``oneOf``, ``properties``), or None; what a type hint's schema says, not all of JSON Schema."""
    if not isinstance(schema, dict):
        return None
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives and all(_type_problem(value, alt, where) for alt in alternatives):
        return f"{where} is {_json_name(value)}, which fits none of its types"
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    known = [t for t in types if t in _JSON_TYPES]
    if known and not any(isinstance(value, _JSON_TYPES[t]) and not (isinstance(value, bool) and t != "boolean")
                         for t in known):
        return f"{where} must be {' or '.join(known)}, got {_json_name(value)}"
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        return f"{where} must be one of {', '.join(json.dumps(v) for v in schema['enum'])}, got {json.dumps(value)}"
    if isinstance(value, list):
        for i, item in enumerate(value):
            problem = _type_problem(item, schema.get("items"), f"{where}[{i}]")
            if problem:
                return problem
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                problem = _type_problem(value[key], sub, f"{where}.{key}")
                if problem:
                    return problem
    return None


def _json_name(value: Any) -> str:
    for name, kinds in _JSON_TYPES.items():
        if isinstance(value, kinds) and not (isinstance(value, bool) and name != "boolean"):
            return f"{name} {json.dumps(value, default=str)[:40]}"
    return type(value).__name__


def argument_problem(arguments: dict, parameters: dict | None) -> str | None:
    """F04: why a call's ``arguments`` do not fit its schema's ``parameters`` (an argument of the
    wrong JSON type, or outside its ``enum``), as the one-line error the model reads; None when they
    fit or there is no schema. Missing and extra arguments are left to the call's own TypeError."""
    if not isinstance(parameters, dict):
        return None
    for name, schema in (parameters.get("properties") or {}).items():
        if name in arguments:
            problem = _type_problem(arguments[name], schema, f"argument {name!r}")
            if problem:
                return f"TypeError: {problem} (the tool's schema)"
    return None


def _run_in_thread(fn: Callable, arguments: dict, timeout_s: float) -> ToolOutput:
    """``fn(**arguments)`` in a daemon thread of its own: a call past ``timeout_s`` is abandoned there
    and can neither keep a finished run from exiting (F02) nor hold a pool slot from later calls."""
    done, box = threading.Event(), {}

    def call() -> None:
        try:
            box["value"] = fn(**arguments)
        except BaseException as exc:  # noqa: BLE001 - any tool failure (SystemExit too) is an observation
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=call, name="grpolab-tool", daemon=True).start()
    if not done.wait(timeout_s):
        return ToolOutput("", f"timed out after {timeout_s}s")
    if "error" in box:
        exc = box["error"]
        return ToolOutput("", f"{type(exc).__name__}: {exc}")
    try:
        return ToolOutput(result_text(box["value"]))
    except Exception as exc:  # noqa: BLE001 - a result json cannot write
        return ToolOutput("", f"{type(exc).__name__}: {exc}")


def result_text(value: Any) -> str:
    """A tool's result as the text of its ``tool`` message: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def class_methods(cls: type) -> list[str]:
    """The public methods of a TRL-style environment class (its tools); ``reset`` is not one."""
    return [n for n, m in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_") and n != "reset"]


def load_tool_spec(spec: str) -> tuple[str, Any]:
    """``"pkg.mod:name"`` -> ("function", fn) or ("class", cls); one line when it is neither."""
    obj = import_callable(spec, "tool")
    return ("class", obj) if inspect.isclass(obj) else ("function", obj)


@dataclass
class ChatRenderer:
    """The chat template with the tools: renders conversations and computes what follows a sampled turn."""

    tokenizer: Any
    schemas: list[dict]
    chat_template: str | None = None
    _base: str = field(default="", init=False)
    _end_of_turn: str = field(default="", init=False)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, with_tools: bool = True) -> str:
        """The template's text for ``messages`` with the tools; a template error is one line."""
        extra = {"chat_template": self.chat_template} if self.chat_template is not None else {}
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      tools=self.schemas if with_tools else None, **extra)
        except Exception as exc:  # noqa: BLE001 - jinja raises its own errors
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"the chat template cannot render the tools and their calls ({first})") from None

    def check(self) -> None:
        """The template renders every schema and is prefix-stable over a call and its result; else one line."""
        probe = [{"role": "user", "content": "Q"}]
        with_tools = self.render(probe, True)
        without = self.render(probe, True, with_tools=False)
        missing = [s["function"]["name"] for s in self.schemas if s["function"]["name"] not in with_tools]
        if with_tools == without or missing:
            raise ValueError(f"the chat template does not render the tool schemas ({', '.join(missing) or 'tools='} "
                             "missing from the prompt): give env.chat_template: hermes, or a model whose template "
                             "supports tools")
        self._base = with_tools
        turn = self.render(probe + [{"role": "assistant", "content": _SENTINEL}])
        if not turn.startswith(with_tools) or _SENTINEL not in turn:
            raise ValueError("the chat template renders an assistant turn that does not continue the prompt; "
                             "tool turns cannot be appended to the sampled ids")
        self._end_of_turn = turn[turn.index(_SENTINEL) + len(_SENTINEL):]

    def continuation(self, sampled_text: str, content: str, calls: Sequence[CallRequest],
                     results: Sequence[str]) -> tuple[str, bool]:
        """(the text to append after the sampled turn: end-of-turn glue, the ``tool`` messages and the
        next generation prompt; whether the template re-renders the turn exactly as sampled)."""
        assistant = {"role": "assistant", "content": content,
                     "tool_calls": [c.message() for c in calls if c.problem is None]}
        tools = [{"role": "tool", "name": c.name or "error", "content": r} for c, r in zip(calls, results)]
        return self.after_turn([{"role": "user", "content": "Q"}], assistant, tools, sampled_text)

    def after_turn(self, history: list[dict], assistant: dict, following: list[dict],
                   sampled_text: str) -> tuple[str, bool]:
        """What follows a sampled assistant turn (rendered as ``assistant`` after ``history``) when
        ``following`` messages come next: the text to tokenise and append, and whether the template's
        rendering of the turn starts with exactly the sampled text (else the sampled ids win)."""
        base = self.render(history, True)
        ref = self.render(history + [assistant])
        full = self.render(history + [assistant, *following], True)
        if not (ref.startswith(base) and full.startswith(ref)):
            raise ValueError("the chat template renders a conversation's prefix differently once more messages "
                             "follow; the next turn cannot continue the sampled ids")
        turn = ref[len(base):]
        if turn.startswith(sampled_text):
            return turn[len(sampled_text):] + full[len(ref):], True
        end = self._end_of_turn
        overlap = next((k for k in range(len(end), 0, -1) if sampled_text.endswith(end[:k])), 0)
        return end[overlap:] + full[len(ref):], False
