"""Environments for multi-turn rollouts with tools: retrieval (BM25 over a local corpus), a safe
calculator and custom ``module:function`` tools.

How a trainer uses one::

    env = build_env(tools=["search"], corpus="corpus.jsonl", top_k=1, max_turns=3, max_total_tokens=160)
    backend = EnvBackend(make_backend("hf", model, tokenizer), env)   # or rollouts(backend, env, ...)
    out = backend.generate(prompts, group_size, sampling)             # multi-turn, prompt-major
    # train with response_mask & loss_mask: observation tokens get no gradient
    scores = apply_call_cost(scorer.score([r.response for r in out], answers), out, env.call_cost)

Layer: imports core, data, rewards, rollout and models only (never algorithms or the CLI).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import Tool, ToolCall, ToolEnv, ToolOutput
from .calculator import Calculator, CalculatorError
from .custom import CustomTool, resolve_tool
from .demonstrations import Demonstration, replay_demonstrations, split_demonstration, tool_metrics
from .retrieval import (
    BM25Index,
    BM25Settings,
    CorpusError,
    RetrievalAugmentedTemplate,
    SearchTool,
    fill_template,
    load_corpus,
    open_index,
    retrieval_augmented_prompts,
    truncate,
)
from .rollouts import EnvBackend, apply_call_cost, loss_mask_tensor, rollouts


def build_env(tools: Sequence[Any] = ("search",), *, corpus: str | None = None, text_field: str = "text",
              cache_dir: str | None = None, top_k: int = 1, max_chars: int | None = 200, max_tokens: int | None = None,
              tokenizer=None, tool_timeout_s: float = 10.0, **env_options) -> ToolEnv:
    """A ``ToolEnv`` from config values. ``tools``: ``"search"`` (needs ``corpus``), ``"calculate"``,
    ``"pkg.mod:fn"`` (a custom tool, named after its function) or a ``Tool`` object;
    ``env_options``: ``ToolEnv`` fields (``max_turns``, ``max_total_tokens``, ``call_cost``, ...)."""
    built = []
    for spec in tools:
        if not isinstance(spec, str):
            built.append(spec)
        elif spec == "search":
            if corpus is None:
                raise ValueError("the search tool needs a corpus (a JSONL file or a directory of .txt files)")
            built.append(build_retriever(corpus, text_field=text_field, cache_dir=cache_dir, top_k=top_k,
                                         max_chars=max_chars, max_tokens=max_tokens, tokenizer=tokenizer))
        elif spec == "calculate":
            built.append(Calculator())
        elif ":" in spec:
            built.append(CustomTool(spec, name=spec.partition(":")[2], timeout_s=tool_timeout_s))
        else:
            raise ValueError(f"unknown tool {spec!r}: expected 'search', 'calculate' or 'package.module:function'")
    return ToolEnv({t.name: t for t in built}, **env_options)


def build_retriever(corpus: str, *, text_field: str = "text", cache_dir: str | None = None, top_k: int = 1,
                    max_chars: int | None = 200, max_tokens: int | None = None, tokenizer=None) -> SearchTool:
    """BM25 over ``corpus`` (built once, cached in ``cache_dir``): the search tool, and the
    retriever of retrieval-augmented prompts."""
    return SearchTool(open_index(corpus, text_field, cache_dir), top_k, max_chars, max_tokens, tokenizer)


# a config's ``retrieval:`` (retrieval-augmented prompts): build_retriever's keys, ``corpus`` required
RETRIEVAL_KEYS = ("corpus", "text_field", "cache_dir", "top_k", "max_chars")


def check_retrieval_options(options: Any) -> dict[str, Any]:
    """``options`` if it is a mapping of ``RETRIEVAL_KEYS`` with a ``corpus``; else a one-line ValueError."""
    if not isinstance(options, dict):
        raise ValueError(f"expected a mapping of retrieval keys, got {type(options).__name__}")
    unknown = sorted(set(options) - set(RETRIEVAL_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; expected some of {', '.join(RETRIEVAL_KEYS)}")
    if not options.get("corpus"):
        raise ValueError("needs a corpus (a JSONL file or a directory of .txt files)")
    return options


def retrieval_template(template, options: dict[str, Any]) -> RetrievalAugmentedTemplate:
    """``template`` (with ``{context}``) filled, per question, with the top passages a BM25
    retriever built from ``options`` (``RETRIEVAL_KEYS``) finds for it."""
    options = check_retrieval_options(options)
    return RetrievalAugmentedTemplate(template, build_retriever(**options))


def env_option_names() -> list[str]:
    """The keys a config's ``env`` mapping may hold: ``build_env``'s keywords and ``ToolEnv``'s fields."""
    import dataclasses
    import inspect

    names = [p for p in inspect.signature(build_env).parameters if p not in ("tokenizer", "env_options")]
    fields = [f.name for f in dataclasses.fields(ToolEnv) if f.init and not f.name.startswith("_")]
    return names + [f for f in fields if f != "tools" and f not in names]


def check_env_options(options: Any) -> dict[str, Any]:
    """``options`` if it is a mapping of ``build_env`` keys; else a one-line ValueError naming the
    unknown keys (a config's ``env:``, an ``--env`` file)."""
    if not isinstance(options, dict):
        raise ValueError(f"expected a mapping of environment keys, got {type(options).__name__}")
    unknown = sorted(set(options) - set(env_option_names()))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; expected some of {', '.join(env_option_names())}")
    return options


def load_env_file(path: str | Path) -> dict[str, Any]:
    """The environment keys in the YAML file ``path`` (``grpolab eval/compare --env``), checked;
    errors name the file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such environment file")
    try:
        return check_env_options(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: {' '.join(str(exc).split())}") from None


__all__ = [
    "RETRIEVAL_KEYS", "BM25Index", "BM25Settings", "Calculator", "CalculatorError", "CorpusError", "CustomTool", "Demonstration",
    "EnvBackend", "RetrievalAugmentedTemplate", "SearchTool", "Tool", "ToolCall", "ToolEnv", "ToolOutput",
    "apply_call_cost", "build_env", "build_retriever", "check_env_options", "check_retrieval_options", "env_option_names", "fill_template", "load_corpus",
    "load_env_file", "loss_mask_tensor", "open_index",
    "replay_demonstrations", "resolve_tool", "retrieval_augmented_prompts", "retrieval_template", "rollouts", "split_demonstration",
    "tool_metrics", "truncate",
]
