"""Prompt templates: the built-in ``*.prompt`` files of this package, or a user's file."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .base import PromptTemplate, TemplateError
from .chat import ChatTemplate

BUILTIN_TEMPLATES = ("r1_zero", "question_only", "compact", "rag_compact")
CHAT_TEMPLATES = ("chat", "chat_r1")  # rendered by the tokenizer's chat template (prompts/chat.py)


def load_template(name_or_path: str, tokenizer=None, system_prompt: str | None = None):
    """A built-in template by name, a chat preset (``chat``, ``chat_r1``: rendered by ``tokenizer``'s
    chat template, with ``system_prompt``), or a template read verbatim from a UTF-8 text file (a
    trailing newline is kept: the prompt ends where the file does)."""
    if name_or_path in CHAT_TEMPLATES:
        if tokenizer is None:
            raise TemplateError(f"prompt template {name_or_path!r} needs the model's tokenizer")
        return ChatTemplate(tokenizer, name_or_path, system_prompt)
    if system_prompt is not None:
        raise TemplateError(f"system_prompt needs a chat template (prompt_template: chat or chat_r1), not "
                            f"{name_or_path!r}")
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
    return PromptTemplate(str(path), text)


R1_ZERO_PROMPT = load_template("r1_zero").text


_MARK = "\x00question\x00"


def holds_template(template, prompt) -> bool:
    """Whether the text ``prompt`` is already a question formatted by ``template`` (CS336's sft.jsonl
    holds r1_zero prompts): it starts with the template's text before ``{question}`` (not empty) and
    ends with its text after. A template that cannot render a bare question (retrieval) holds nothing."""
    if not isinstance(prompt, str):
        return False
    try:
        before, _, after = template.format(_MARK).partition(_MARK)
    except (TemplateError, TypeError, ValueError, KeyError):
        return False
    return bool(before) and len(prompt) > len(before) + len(after) and prompt.startswith(before) \
        and prompt.endswith(after)


def held_template(prompts) -> str | None:
    """The built-in text template (``r1_zero``, ``compact``) that every one of ``prompts`` already
    holds (``holds_template``), or None."""
    prompts = list(prompts)
    for name in ("r1_zero", "compact"):
        template = load_template(name)
        if prompts and all(holds_template(template, p) for p in prompts):
            return name
    return None
