"""A tool environment from config values: ``build_env`` (a config's ``env:``, an ``--env`` file),
the retriever of retrieval-augmented prompts (``retrieval:``), and the validation of both.

Validation is a pydantic model per mapping, so a wrong value is a one-line error naming the key
(``max_turns: two``, ``tools: search`` — a string, not a list — or a custom tool named like a
built-in), raised before any model, corpus or worker is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .base import ToolEnv
from .calculator import Calculator
from .chat_rollouts import ChatToolEnv
from .chat_tools import (
    CALCULATE_SCHEMA,
    CHAT_TEMPLATES,
    SEARCH_SCHEMA,
    ChatRenderer,
    class_methods,
    function_schema,
    load_tool_spec,
)
from .custom import CustomTool
from .retrieval import RetrievalAugmentedTemplate, SearchTool, open_index

BUILTIN_TOOLS = ("search", "calculate")


def _custom_tool_name(spec: str) -> str:
    return spec.partition(":")[2]


def _check_tool_spec(spec: Any) -> Any:
    """A tool entry: a built-in name, ``"pkg.mod:fn"`` (not named like a built-in), or a Tool object."""
    if not isinstance(spec, str):
        if not (isinstance(getattr(spec, "name", None), str) and callable(getattr(spec, "run", None))):
            raise ValueError(f"{spec!r} is not a tool: expected 'search', 'calculate' or 'package.module:function'")
        return spec
    if spec in BUILTIN_TOOLS:
        return spec
    module, colon, name = spec.partition(":")
    if not colon or not module or not name:
        raise ValueError(f"unknown tool {spec!r}: expected 'search', 'calculate' or 'package.module:function'")
    if name in BUILTIN_TOOLS:
        raise ValueError(f"custom tool {spec!r} is named like the built-in {name!r} tool (the model would write "
                         f"<{name}>): rename the function")
    return spec


class EnvSettings(BaseModel):
    """The keys of a config's ``env:`` (``build_env``'s keywords and ``ToolEnv``'s limits)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    tools: list[Any] = Field(default_factory=lambda: ["search"], min_length=1)
    corpus: str | None = None
    text_field: str = "text"
    cache_dir: str | None = None
    top_k: int = Field(1, ge=1)
    max_chars: int | None = Field(200, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    tool_timeout_s: float = Field(10.0, gt=0)
    worker_memory_limit_mb: int | None = Field(4096, ge=64)
    max_turns: int = Field(4, ge=1)
    max_total_tokens: int = Field(256, ge=1)
    call_cost: float = 0.0
    result_tag: str = "result"
    observation_suffix: str = ""
    answer_stop: str = "</answer>"
    max_query_chars: int = Field(500, ge=1)
    max_observation_chars: int = Field(2000, ge=1)
    max_observation_tokens: int | None = Field(None, ge=1)
    tool_format: Literal["tags", "chat_template"] = "tags"
    """How calls are written: ``tags`` (grpolab's ``<search>q</search>``, for the embedded models) or ``chat_template``
    (the model's own function calling: schemas rendered by its template, calls parsed from its syntax)."""
    chat_template: str | None = None
    """``tool_format: chat_template`` only: a template in place of the tokenizer's (``hermes``: ChatML with tools, as
    Qwen2.5), for a chat model whose own template renders no tools."""
    verifiers: str | None = None
    """A ``verifiers`` environment (an installed name, or a module or ``.py`` file with ``load_environment``): its
    dataset is the task, its rubric the reward, its tools the tools (``pip install -e '.[envs]'``)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """``verifiers`` only: keyword arguments of the environment's ``load_environment(**args)``."""
    rollout_timeout_s: float = Field(120.0, gt=0)
    """A multi-turn ``verifiers`` environment only: the most one rollout (its turns and its rubric) may take."""
    load_timeout_s: float = Field(120.0, gt=0)
    """``verifiers`` only, seconds: the most its ``load_environment`` may take when it is first built in a supervised
    child before the run starts (a hang or an ``os._exit`` there is one line); raise it for a slow dataset download."""

    @field_validator("verifiers")
    @classmethod
    def _verifiers_named(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():  # V10: not the internal "build it with grpolab.envs.vf"
            raise ValueError(f"expected an environment name, a module or a .py file, got {value!r}")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError(f"expected a list of tools, e.g. [{value}], got the string {value!r}")
        return value

    @field_validator("tools")
    @classmethod
    def _tools_known(cls, value: list[Any]) -> list[Any]:
        names = []
        for spec in value:
            spec = _check_tool_spec(spec)
            name = spec if spec in BUILTIN_TOOLS else (_custom_tool_name(spec) if isinstance(spec, str) else spec.name)
            if name in names:
                raise ValueError(f"two tools are named {name!r}")
            names.append(name)
        return value


class RetrievalSettings(BaseModel):
    """The keys of a config's ``retrieval:`` (retrieval-augmented prompts)."""

    model_config = ConfigDict(extra="forbid")

    corpus: str = Field(min_length=1)
    text_field: str = "text"
    cache_dir: str | None = None
    top_k: int = Field(1, ge=1)
    max_chars: int | None = Field(200, ge=1)


# a config's ``retrieval:``: build_retriever's keys, ``corpus`` required
RETRIEVAL_KEYS = tuple(RetrievalSettings.model_fields)


def _one_line(exc: ValidationError) -> str:
    """The first error of ``exc`` as ``key: rule`` (pydantic's own wording, on one line)."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    message = "required" if err["type"] == "missing" else err["msg"].removeprefix("Value error, ")
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return " ".join(f"{loc}: {message}{more}".split())


def _validate(model: type[BaseModel], options: Any, kind: str) -> dict[str, Any]:
    if not isinstance(options, dict):
        raise ValueError(f"expected a mapping of {kind} keys, got {type(options).__name__}")
    unknown = sorted(str(k) for k in set(options) - set(model.model_fields))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; expected some of {', '.join(model.model_fields)}")
    try:
        checked = model.model_validate(options)
    except ValidationError as exc:
        if any(e["type"] == "missing" and e["loc"] == ("corpus",) for e in exc.errors()):
            raise ValueError("needs a corpus (a JSONL file or a directory of .txt files)") from None
        raise ValueError(_one_line(exc)) from None
    return {k: getattr(checked, k) for k in options}


def env_option_names() -> list[str]:
    """The keys a config's ``env`` mapping may hold."""
    return list(EnvSettings.model_fields)


def check_env_options(options: Any) -> dict[str, Any]:
    """``options`` (a config's ``env:``, an ``--env`` file) with its values checked (and coerced:
    ``"2"`` -> 2); else a one-line ValueError naming the key and the rule."""
    return _validate(EnvSettings, options, "environment")


def check_retrieval_options(options: Any) -> dict[str, Any]:
    """``options`` if it is a valid mapping of ``RETRIEVAL_KEYS`` with a ``corpus``; else a one-line ValueError."""
    return _validate(RetrievalSettings, options, "retrieval")


def build_env(tools: Sequence[Any] = ("search",), *, corpus: str | None = None, text_field: str = "text",
              cache_dir: str | None = None, top_k: int = 1, max_chars: int | None = 200, max_tokens: int | None = None,
              tokenizer=None, tool_timeout_s: float = 10.0, worker_memory_limit_mb: int | None = 4096,
              **env_options) -> ToolEnv:
    """A ``ToolEnv`` from config values. ``tools``: ``"search"`` (needs ``corpus``), ``"calculate"``,
    ``"pkg.mod:fn"`` (a custom tool, named after its function, in a worker process limited to
    ``worker_memory_limit_mb`` of address space) or a ``Tool`` object; ``env_options``: ``ToolEnv``
    fields (``max_turns``, ``max_total_tokens``, ``call_cost``, ``max_observation_chars``, ...)."""
    if isinstance(tools, str):
        raise ValueError(f"tools: expected a list of tools, e.g. [{tools}], got the string {tools!r}")
    tool_format = env_options.pop("tool_format", "tags")
    chat_template = env_options.pop("chat_template", None)
    env_options.pop("args", None)
    if env_options.pop("rollout_timeout_s", None) is not None:
        raise ValueError("env.rollout_timeout_s is for a multi-turn verifiers environment (env.verifiers)")
    if env_options.pop("load_timeout_s", None) is not None:
        raise ValueError("env.load_timeout_s is for a verifiers environment (env.verifiers)")
    if env_options.pop("verifiers", None) is not None:
        raise ValueError("env.verifiers: expected an environment name, a module or a .py file, got ''")
    if tool_format == "chat_template":
        search = (lambda: build_retriever(corpus, text_field=text_field, cache_dir=cache_dir, top_k=top_k,
                                          max_chars=max_chars, max_tokens=max_tokens, tokenizer=tokenizer))
        return build_chat_env(tools, tokenizer, chat_template, search=search if corpus else None,
                              tool_timeout_s=tool_timeout_s, worker_memory_limit_mb=worker_memory_limit_mb,
                              **env_options)
    if chat_template is not None:
        raise ValueError("env.chat_template is for tool_format: chat_template")
    built = []
    for spec in tools:
        spec = _check_tool_spec(spec)
        if not isinstance(spec, str):
            built.append(spec)
        elif spec == "search":
            if corpus is None:
                raise ValueError("the search tool needs a corpus (a JSONL file or a directory of .txt files)")
            built.append(build_retriever(corpus, text_field=text_field, cache_dir=cache_dir, top_k=top_k,
                                         max_chars=max_chars, max_tokens=max_tokens, tokenizer=tokenizer))
        elif spec == "calculate":
            built.append(Calculator())
        else:
            built.append(CustomTool(spec, name=_custom_tool_name(spec), timeout_s=tool_timeout_s,
                                    memory_limit_mb=worker_memory_limit_mb))
    names = [t.name for t in built]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two tools are named {name!r}")
    return ToolEnv({t.name: t for t in built}, **env_options)


CHAT_ENV_KEYS = ("max_turns", "max_total_tokens", "call_cost", "max_observation_chars", "max_observation_tokens")


def build_chat_env(tools: Sequence[Any], tokenizer, chat_template: str | None = None, *, search=None,
                   tool_timeout_s: float = 10.0, worker_memory_limit_mb: int | None = 4096, **limits) -> ChatToolEnv:
    """A ``ChatToolEnv`` (native function calling): ``tools`` are ``"search"`` (``search()`` builds
    the retriever), ``"calculate"``, ``"pkg.mod:fn"`` (a typed, documented function, run in a worker
    process), ``"pkg.mod:Class"`` (its public methods, one instance per rollout) or Python callables
    (run in a thread); the schemas are checked against the template before anything runs."""
    if tokenizer is None:
        raise ValueError("tool_format: chat_template needs the model's tokenizer (its chat template renders the tools)")
    template = CHAT_TEMPLATES.get(chat_template, chat_template)
    ignored = {k: v for k, v in limits.items() if k not in CHAT_ENV_KEYS}
    if ignored:
        raise ValueError(f"env key(s) {', '.join(sorted(ignored))} are for tool_format: tags (grpolab's tags); "
                         "a chat model's calls and results are written by its template")
    schemas, functions, process, classes = [], {}, {}, []
    for spec in tools:
        if spec == "search":
            if search is None:
                raise ValueError("the search tool needs a corpus (a JSONL file or a directory of .txt files)")
            schemas.append(SEARCH_SCHEMA)
            functions["search"] = _builtin_call(search(), "query")
        elif spec == "calculate":
            schemas.append(CALCULATE_SCHEMA)
            functions["calculate"] = _builtin_call(Calculator(), "expression")
        elif isinstance(spec, str):
            kind, obj = load_tool_spec(spec)
            if kind == "class":
                probe = obj()
                schemas += [function_schema(getattr(probe, name)) for name in class_methods(obj)]
                classes.append(obj)
            else:
                name = _custom_tool_name(spec)
                schemas.append(function_schema(obj, name))
                process[name] = CustomTool(spec, name=name, timeout_s=tool_timeout_s,
                                           memory_limit_mb=worker_memory_limit_mb)
        elif callable(spec):
            schema = function_schema(spec)
            schemas.append(schema)
            functions[schema["function"]["name"]] = spec
        else:
            raise ValueError(f"{spec!r} is not a tool for tool_format: chat_template")
    names = [s["function"]["name"] for s in schemas]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two tools are named {twice[0]!r}")
    renderer = ChatRenderer(tokenizer, schemas, template)
    renderer.check()
    return ChatToolEnv(renderer, functions, process, classes, tool_timeout_s=tool_timeout_s, **limits)


def _builtin_call(tool, param: str):
    """A built-in ``Tool`` (``run(queries)``) as a function of its one argument."""
    def call(**arguments):
        if set(arguments) != {param}:
            raise TypeError(f"{tool.name}() takes exactly one argument, {param!r}")
        out = tool.run([str(arguments[param])])[0]
        if out.error is not None:
            raise ValueError(out.error)
        return out.text
    call.__name__ = tool.name
    return call


def build_retriever(corpus: str, *, text_field: str = "text", cache_dir: str | None = None, top_k: int = 1,
                    max_chars: int | None = 200, max_tokens: int | None = None, tokenizer=None) -> SearchTool:
    """BM25 over ``corpus`` (built once, cached in ``cache_dir``): the search tool, and the
    retriever of retrieval-augmented prompts."""
    return SearchTool(open_index(corpus, text_field, cache_dir), top_k, max_chars, max_tokens, tokenizer)


def retrieval_template(template, options: dict[str, Any]) -> RetrievalAugmentedTemplate:
    """``template`` (with ``{context}``) filled, per question, with the top passages a BM25
    retriever built from ``options`` (``RETRIEVAL_KEYS``) finds for it."""
    options = check_retrieval_options(options)
    return RetrievalAugmentedTemplate(template, build_retriever(**options))


def load_env_file(path: str | Path) -> dict[str, Any]:
    """The environment keys in the YAML file ``path`` (``grpolab eval/compare --env``), checked;
    errors name the file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such environment file")
    try:
        options = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if isinstance(options, dict) and set(options) == {"env"}:  # a config's env: block, pasted whole
            options = options["env"] or {}
        return check_env_options(options)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: {' '.join(str(exc).split())}") from None
