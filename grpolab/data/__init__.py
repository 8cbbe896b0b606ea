"""Datasets, prompt templates and the embedded tasks."""

from .datasets import (
    DataError,
    Example,
    Loaded,
    PreferencePair,
    SFTPair,
    gsm8k_final_answer,
    load_gsm8k,
    load_jsonl,
    load_math,
    load_preferences,
    load_sft_pairs,
    read_jsonl_records,
    require_field,
)
from .prompts import (
    BUILTIN_TEMPLATES,
    CHAT_TEMPLATES,
    ChatTemplate,
    PromptTemplate,
    TemplateError,
    conversation_segments,
    has_chat_template,
    is_conversation,
    load_template,
    render_chat,
)
from .sources import load_examples, load_hf_dataset
from .tasks import TASKS, ArithmeticTask, CountdownTask, get_task, split_of

__all__ = [
    "ArithmeticTask", "BUILTIN_TEMPLATES", "CHAT_TEMPLATES", "ChatTemplate", "conversation_segments",
    "has_chat_template", "is_conversation", "render_chat", "CountdownTask", "DataError", "Example", "Loaded",
    "PreferencePair", "PromptTemplate", "SFTPair", "TASKS", "TemplateError", "get_task",
    "gsm8k_final_answer", "load_examples", "load_gsm8k", "load_hf_dataset", "load_jsonl",
    "load_math", "load_preferences", "load_sft_pairs", "load_template", "read_jsonl_records", "require_field",
    "split_of",
]
