"""Environments for multi-turn rollouts with tools: retrieval (BM25 over a local corpus), a safe
calculator and custom ``module:function`` tools, in grpolab's tag format or in a chat model's own
function-calling format (``tool_format: chat_template``, ``chat_tools.py``).

How a trainer uses one::

    env = build_env(tools=["search"], corpus="corpus.jsonl", top_k=1, max_turns=3, max_total_tokens=160)
    backend = EnvBackend(make_backend("hf", model, tokenizer), env)   # or rollouts(backend, env, ...)
    out = backend.generate(prompts, group_size, sampling)             # multi-turn, prompt-major
    # train with response_mask & loss_mask: observation tokens get no gradient
    scores = apply_call_cost(scorer.score([r.scored_response for r in out], answers), out, env.call_cost)

This module only re-exports: the environment is built in ``build.py``.

Layer: imports core, data, rewards, rollout and models only (never algorithms or the CLI).
"""

from __future__ import annotations

from .base import Tool, ToolCall, ToolEnv, ToolOutput, strip_tags
from .build import (
    BUILTIN_TOOLS,
    RETRIEVAL_KEYS,
    EnvSettings,
    RetrievalSettings,
    build_chat_env,
    build_env,
    build_retriever,
    check_env_options,
    check_retrieval_options,
    env_option_names,
    load_env_file,
    retrieval_template,
)
from .calculator import Calculator, CalculatorError
from .chat_rollouts import ChatToolEnv, chat_rollouts
from .chat_tools import HERMES_TEMPLATE, ChatRenderer, function_schema, parse_tool_calls
from .custom import CustomTool, resolve_tool
from .demonstrations import (
    Demonstration,
    replay_chat_demonstrations,
    replay_demonstrations,
    split_demonstration,
    tool_metrics,
)
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

__all__ = [
    "BUILTIN_TOOLS",
    "EnvSettings",
    "RetrievalSettings",
    "strip_tags",
    "RETRIEVAL_KEYS",
    "BM25Index",
    "BM25Settings",
    "Calculator",
    "CalculatorError",
    "ChatRenderer",
    "ChatToolEnv",
    "HERMES_TEMPLATE",
    "build_chat_env",
    "chat_rollouts",
    "function_schema",
    "parse_tool_calls",
    "CorpusError",
    "CustomTool",
    "Demonstration",
    "EnvBackend",
    "RetrievalAugmentedTemplate",
    "SearchTool",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolOutput",
    "apply_call_cost",
    "build_env",
    "build_retriever",
    "check_env_options",
    "check_retrieval_options",
    "env_option_names",
    "fill_template",
    "load_corpus",
    "load_env_file",
    "loss_mask_tensor",
    "open_index",
    "replay_chat_demonstrations",
    "replay_demonstrations",
    "resolve_tool",
    "retrieval_augmented_prompts",
    "retrieval_template",
    "rollouts",
    "split_demonstration",
    "tool_metrics",
    "truncate",
]
