"""Prompt templates: ``r1_zero`` (the DeepSeek R1-Zero prompt CS336 evaluates with),
``question_only`` (``{question}``), ``compact`` (a short R1-Zero-style prompt for the embedded
character-level model), or a user's file. A template must contain ``{question}``; only that
placeholder is substituted, so other braces (LaTeX) are left alone. Templates end where the model
continues: ``r1_zero`` ends with ``Assistant: <think>`` and no newline."""

from .templates import BUILTIN_TEMPLATES, R1_ZERO_PROMPT, PromptTemplate, TemplateError, load_template

__all__ = ["BUILTIN_TEMPLATES", "R1_ZERO_PROMPT", "PromptTemplate", "TemplateError", "load_template"]
