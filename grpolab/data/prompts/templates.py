"""Prompt templates: the built-in ``*.prompt`` files of this package, or a user's file."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUILTIN_TEMPLATES = ("r1_zero", "question_only", "compact", "rag_compact")


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
        return self.text.replace("{question}", question)

    def __call__(self, question: str) -> str:
        return self.format(question)


def load_template(name_or_path: str) -> PromptTemplate:
    """A built-in template by name, or a template read from a UTF-8 text file."""
    if name_or_path in BUILTIN_TEMPLATES:
        text = resources.files(__package__).joinpath(f"{name_or_path}.prompt").read_text(encoding="utf-8")
        return PromptTemplate(name_or_path, text)
    path = Path(name_or_path)
    if not path.is_file():
        raise TemplateError(
            f"unknown prompt template {name_or_path!r}: not one of {', '.join(BUILTIN_TEMPLATES)} and not a file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TemplateError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    return PromptTemplate(str(path), text.rstrip("\n"))


R1_ZERO_PROMPT = load_template("r1_zero").text
