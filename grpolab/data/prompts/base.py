"""What every prompt template shares: the error a bad template raises, and a plain text template
with a ``{question}`` placeholder. ``templates.py`` (the built-in and file templates) and
``chat.py`` (templates rendered by a tokenizer's chat template) both build on it."""

from __future__ import annotations

from dataclasses import dataclass


class TemplateError(ValueError):
    """An unknown template name, an unreadable template file, or no ``{question}`` placeholder."""


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    text: str

    def __post_init__(self):
        if "{question}" not in self.text:
            raise TemplateError(f"prompt template {self.name!r} has no {{question}} placeholder")

    def format(self, question: str) -> str:
        if not isinstance(question, str):  # a conversation (list of messages) needs the tokenizer's template
            raise TemplateError(f"prompt template {self.name!r} takes text; a question given as a list of messages "
                                "needs a chat template (prompt_template: chat)")
        return self.text.replace("{question}", question)

    def __call__(self, question: str) -> str:
        return self.format(question)
