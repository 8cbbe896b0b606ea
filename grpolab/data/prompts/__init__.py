"""Prompt templates: ``r1_zero`` (the DeepSeek R1-Zero prompt CS336 evaluates with),
``question_only`` (``{question}``), ``compact`` (a short R1-Zero-style prompt for the embedded
character-level model), ``rag_compact`` (with retrieved ``{context}``), the chat presets ``chat``
and ``chat_r1`` (rendered by the tokenizer's own chat template, ``chat.py``), or a user's file (read
verbatim). A text template must contain ``{question}``; only that placeholder is substituted, so
other braces (LaTeX) are left alone. Templates end where the model continues: ``r1_zero`` ends with
``Assistant: <think>`` and no newline; a chat prompt ends with the assistant's generation prompt."""

from .chat import CHAT_PRESETS, ChatTemplate, conversation_segments, has_chat_template, is_conversation, render_chat
from .templates import (
    BUILTIN_TEMPLATES,
    CHAT_TEMPLATES,
    R1_ZERO_PROMPT,
    PromptTemplate,
    TemplateError,
    held_template,
    holds_template,
    load_template,
)

__all__ = ["BUILTIN_TEMPLATES", "CHAT_PRESETS", "CHAT_TEMPLATES", "ChatTemplate", "PromptTemplate", "R1_ZERO_PROMPT",
           "TemplateError", "conversation_segments", "has_chat_template", "held_template", "holds_template",
           "is_conversation", "load_template",
           "render_chat"]
