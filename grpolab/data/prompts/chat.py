"""Chat prompts: a question rendered through the tokenizer's own chat template
(``tokenizer.apply_chat_template``) as a user message, with ``add_generation_prompt=True``, so the
model continues in the assistant's turn — what a chat model was trained on (TRL does the same for
conversational data).

Presets (``prompt_template: NAME``):

- ``chat``: the question as the user message, nothing added (a tag-free reward reads the answer
  from the whole response);
- ``chat_r1``: the R1 format asked for in the chat: think in ``<think> </think>``, answer in
  ``<answer> </answer>``. The instruction follows the question in the user message (small chat
  models follow an instruction there better than in a system prompt), and the assistant's turn
  opens with ``<think>`` as ``r1_zero``'s prompt ends with it: a response is what follows
  ``<think>`` whatever the template (the embedded tasks' worked solutions and the R1 rewards
  assume so). Rewards that read ``<answer>`` tags are applied with any whitespace between
  ``</think>`` and ``<answer>`` (``lenient_format``).

``system_prompt`` (a string, or a file's text) becomes a system message. A question may itself be a
conversation (a list of ``{role, content}`` messages, TRL's conversational format): the system
prompt is put first unless it already has one; a preset named in the config wraps its last user
message in the instruction, while the default template renders it as it is (TRL's way: the data
carries its own instructions).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import TemplateError

R1_INSTRUCTION = ("{question}\n\nThink it through inside <think> </think> tags, then give only the final answer "
                  "inside <answer> </answer> tags: <think> reasoning here </think> <answer> answer here </answer>")


@dataclass(frozen=True)
class ChatPreset:
    instruction: str = "{question}"  # the user message; {question} is replaced by the question
    lenient_format: bool = False  # the reward accepts any whitespace between </think> and <answer>
    prefill: str = ""  # the start of the assistant's turn, written for the model


CHAT_PRESETS = {
    "chat": ChatPreset(),
    "chat_r1": ChatPreset(R1_INSTRUCTION, lenient_format=True, prefill="<think>"),
}


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` has a chat template; a model directory whose ``chat_template.jinja``
    is there but cannot be read as one (a directory) is a TemplateError naming it, not a quiet no."""
    if getattr(tokenizer, "chat_template", None):
        return True
    where = getattr(tokenizer, "name_or_path", None)
    candidate = Path(where) / "chat_template.jinja" if where and Path(where).is_dir() else None
    if candidate is not None and candidate.exists() and not candidate.is_file():
        raise TemplateError(f"{candidate}: is not a file, so the tokenizer has no chat template; make it the "
                            "template's text (Jinja) or remove it")
    return False


PATH_SUFFIXES = (".txt", ".md", ".jinja", ".j2", ".prompt", ".text", ".tmpl")


def looks_like_path(value: str) -> bool:
    """Meant as a file: an existing directory, a one-word value with a ``/`` or a file suffix, or a
    value with both (``my prompts/system.txt``). Prose with a slash (``answer in km/h``) is text."""
    if "\n" in value or len(value) >= 4096:
        return False
    if Path(value).is_dir():
        return True
    slash, suffix = "/" in value, value.lower().endswith(PATH_SUFFIXES)
    one_word = not any(c.isspace() for c in value)
    return (slash and suffix) or (one_word and (slash or suffix))


def read_system_prompt(value: str | None) -> str | None:
    """A system prompt given as text, or as the path of a UTF-8 file (read verbatim). A value that
    looks like a path (``looks_like_path``) but is no readable file is a TemplateError: a typo
    must not become the system message."""
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and "\n" not in value and path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise TemplateError(f"{path}: system prompt file is not valid UTF-8 (byte {exc.start})") from None
        except OSError as exc:
            raise TemplateError(f"{path}: system prompt file cannot be read ({exc.strerror})") from None
    if looks_like_path(value):
        what = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "no such file"
        raise TemplateError(f"system_prompt {value!r} looks like a file path but {what}; give an existing UTF-8 file, "
                            "or the prompt's text (with spaces)")
    return value


def is_conversation(value: Any) -> bool:
    """A list of ``{role, content}`` messages (TRL's conversational format)."""
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


class ChatTemplate:
    """``format(question)`` -> the prompt text the tokenizer's chat template renders for the
    question as a user message (after an optional system message), ending with the assistant's
    generation prompt. The rendered text is tokenised without special tokens, as every prompt is:
    the chat template writes its own (e.g. ``<|im_start|>``)."""

    def __init__(self, tokenizer, preset: str = "chat", system_prompt: str | None = None):
        if preset not in CHAT_PRESETS:
            raise TemplateError(f"unknown chat preset {preset!r}; expected one of {', '.join(CHAT_PRESETS)}")
        if not has_chat_template(tokenizer):
            raise TemplateError(f"prompt_template {preset!r}: the tokenizer ({type(tokenizer).__name__}) has no chat "
                                "template; use a text template (compact, r1_zero, question_only or a file)")
        self.name, self.tokenizer = preset, tokenizer
        self.preset = CHAT_PRESETS[preset]
        self.system_prompt = read_system_prompt(system_prompt)
        # where the system prompt came from, for errors: its file, or None (given as text)
        self.system_prompt_file = system_prompt if system_prompt is not None and self.system_prompt != system_prompt \
            else None
        self.lenient_format = self.preset.lenient_format
        # a conversation (TRL's conversational data) carries its own instructions: rendered as it is
        # unless the preset was asked for by name (prompt_template given)
        self.wrap_conversations = True
        self.tools: list[dict] | None = None  # function schemas rendered into every prompt (native function calling)
        self.chat_template: str | None = None  # a template in place of the tokenizer's (env.chat_template)
        self.rendered: dict[str, Any] = {}  # each prompt's text -> its question (an environment looks its row up)
        self.text = self.format("{question}")  # what the prompt looks like (messages, logs)

    def use_tools(self, schemas: list[dict], chat_template: str | None = None) -> None:
        """Render every prompt with the tool ``schemas`` (and ``chat_template``, when given)."""
        self.tools, self.chat_template = list(schemas), chat_template
        self.text = self.format("{question}")

    def messages(self, question: str | list[dict]) -> list[dict]:
        """The conversation the prompt renders: [system,] user (the question in the instruction)."""
        if is_conversation(question):
            msgs = [dict(m) for m in question]
        elif isinstance(question, str):
            msgs = [{"role": "user", "content": question}]
        else:
            raise TemplateError(
                f"a question must be text or a list of {{role, content}} messages, got {question!r:.80}"
            )
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if users and self._wraps(question) and self.preset.instruction != "{question}":
            i = users[-1]
            msgs[i]["content"] = self.preset.instruction.replace("{question}", str(msgs[i]["content"]))
        return self.with_system(msgs)

    def with_system(self, messages: list[dict]) -> list[dict]:
        """``messages`` with the system prompt first, unless there is none or they have their own."""
        if self.system_prompt is None or any(m["role"] == "system" for m in messages):
            return list(messages)
        return [{"role": "system", "content": self.system_prompt}, *messages]

    @property
    def adds_to_questions(self) -> bool:
        """Whether the preset writes into the exchange (an instruction around the question, a prefill)."""
        return self.preset.instruction != "{question}" or bool(self.preset.prefill)

    def _wraps(self, question) -> bool:
        return self.wrap_conversations or not is_conversation(question)

    def format(self, question: str | list[dict]) -> str:
        prefill = self.preset.prefill if self._wraps(question) else ""
        text = render_chat(self.tokenizer, self.messages(question), add_generation_prompt=True, tools=self.tools,
                           chat_template=self.chat_template) + prefill
        if len(self.rendered) < 1_000_000:
            self.rendered[text] = question
        return text

    def __call__(self, question) -> str:
        return self.format(question)


def check_system_prompt_fits(template, tokenizer, limit: int | None, reserve: int = 0, reserved_for: str = "") -> None:
    """A system prompt that alone (with the template around an empty question) leaves no room in
    a context of ``limit`` tokens for ``reserve`` more (``reserved_for`` says what they are) is a
    TemplateError that names it: it is in every prompt, so the first data line is not to blame."""
    system = getattr(template, "system_prompt", None)
    if system is None or limit is None:
        return
    n = len(tokenizer(template.format(""), add_special_tokens=False)["input_ids"])
    if n + reserve > limit:
        where = getattr(template, "system_prompt_file", None) or "system_prompt"
        past = f"; with {reserved_for} {reserve} that exceeds" if reserve else ", past"
        raise TemplateError(f"{where}: the system prompt makes every prompt at least {n} tokens{past} the model's "
                            f"context of {limit} tokens: shorten the system prompt")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None,
                chat_template: str | None = None) -> str:
    """The chat template's text for ``messages`` (with the ``tools`` schemas; ``chat_template`` in
    place of the tokenizer's); a template error is one line."""
    extra = {"tools": tools} if tools else {}
    if chat_template is not None:
        extra["chat_template"] = chat_template
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as exc:  # noqa: BLE001 - jinja raises its own errors (e.g. roles must alternate)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TemplateError(f"the tokenizer's chat template cannot render these messages ({first})") from None


def conversation_segments(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[str, bool]]]:
    """A conversation as (prompt text, [(text, trained), ...]) for SFT: the prompt is everything
    before the first assistant turn (with the generation prompt), then the rest in pieces — each
    assistant turn's content and its end-of-turn token trained, everything else (later user turns,
    the template's glue after the end-of-turn token) not. The pieces are differences of renders of
    growing prefixes, so their concatenation is exactly the template's text for the whole chat."""
    if not is_conversation(messages) or not messages:
        raise TemplateError("messages must be a non-empty list of {role, content} objects")
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise TemplateError("messages has no assistant turn to train on")
    prompt = render_chat(tokenizer, messages[:first], add_generation_prompt=True)
    done, pieces = prompt, []
    eos = tokenizer.eos_token or ""
    for i in range(first, len(messages)):
        if messages[i]["role"] == "assistant":
            before = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
            if not before.startswith(done):
                raise TemplateError("the chat template renders a conversation's prefix differently from the whole; "
                                    "cannot tell the assistant's tokens apart")
            if before != done:
                pieces.append((before[len(done):], False))
            full = render_chat(tokenizer, messages[: i + 1])
            if not full.startswith(before):
                raise TemplateError("the chat template renders a conversation's prefix differently from the whole; "
                                    "cannot tell the assistant's tokens apart")
            turn = full[len(before):]
            cut = turn.rfind(eos) + len(eos) if eos and eos in turn else len(turn.rstrip())
            pieces.append((turn[:cut], True))
            if turn[cut:]:
                pieces.append((turn[cut:], False))
            done = full
    pieces = [(t, trained) for t, trained in pieces if t]
    while pieces and not pieces[-1][1]:  # nothing after the last assistant turn is of use
        pieces.pop()
    return prompt, pieces
