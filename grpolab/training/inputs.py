"""What a run trains and validates on: one place that turns a config's data fields (``task``,
``train_data`` or ``env.verifiers``, ``eval_data``, ``prompt_template``, ``reward``) into examples, a
prompt template and a reward function — for every trainer and for ``grpolab eval``."""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

from ..data import (
    DataError,
    Example,
    PreferencePair,
    SFTPair,
    TemplateError,
    get_task,
    has_chat_template,
    load_examples,
    load_preferences,
    load_sft_pairs,
    load_template,
)
from ..data.prompts import held_template, holds_template
from ..data.tasks.vf import VerifiersTask
from ..envs import retrieval_template
from ..models import EMBEDDED_PREFIX, load_tokenizer, model_directory
from ..rewards import build_reward, has_reward_model, lenient_reward, reward_reads_tags


@dataclass
class Inputs:
    """Training examples, validation examples, the prompt template and the reward function."""

    train: list
    evals: list
    template: Any
    reward: Any
    eval_reward: Any = None  # validation's reward when it differs: the task's verifier beside a reward model


def data_options(cfg) -> dict:
    """The data-file settings of a config, as ``load_examples`` keywords."""
    return {"format": cfg.data_format, "question_field": cfg.question_field, "answer_field": cfg.answer_field,
            "on_error": cfg.data_on_error}


def tokenizer_for_prompts(model: str, tokenizer=None, trust_remote_code: bool = False):
    """The tokenizer whose chat template renders prompts: the one given, else the model
    directory's (cheap: no weights); the embedded models' character tokenizer has none, which
    ``chat``/``chat_r1`` then say as they do for any such tokenizer."""
    if tokenizer is not None:
        return tokenizer
    if not model.startswith(EMBEDDED_PREFIX):
        model_directory(model)  # not a model directory: said as the model loaders say it, not as a tokenizer's failure
    return load_tokenizer(model, trust_remote_code=trust_remote_code)


def default_template_name(task, tokenizer, reward: Any, say: bool = True) -> str:
    """``prompt_template`` when not given: with a tokenizer that has a chat template, the chat
    template — ``chat_r1`` when the reward reads ``<answer>`` tags (every embedded task, r1_zero),
    plain ``chat`` for a tag-free reward — said in one line (``say``); else the task's own, else r1_zero."""
    if has_chat_template(tokenizer):
        name = "chat_r1" if reward_reads_tags(reward if reward is not None else
                                             (task.reward_fn if task is not None else "r1_zero")) else "chat"
        if say and os.environ.get("RANK", "0") == "0":
            print(f"grpolab: the model's tokenizer has a chat template: prompts use it (prompt_template: {name}); "
                  "set prompt_template to choose another", file=sys.stderr)
        return name
    return task.default_template if task is not None else "r1_zero"


def prompt_template_for(task, prompt_template: str | None, retrieval: dict | None = None, *, tokenizer=None,
                        system_prompt: str | None = None, reward: Any = None):
    """The one place that builds every command's prompts: the template given (a chat preset is
    rendered by ``tokenizer``'s chat template, with ``system_prompt``), else the default
    (``default_template_name``). A template with a ``{context}`` placeholder gets the top passages
    of the ``retrieval`` corpus for each question (retrieval-augmented prompts) and is refused
    without one, as ``retrieval`` is without it."""
    name = prompt_template or default_template_name(task, tokenizer, reward)
    template = load_template(name, tokenizer=tokenizer, system_prompt=system_prompt)
    if prompt_template is None and hasattr(template, "wrap_conversations"):
        template.wrap_conversations = False  # conversational data as it is, unless a preset was asked for
    has_context = "{context}" in template.text
    if has_context and retrieval is None:
        raise TemplateError(
            f"prompt template {template.name!r} has a {{context}} placeholder: retrieval-augmented "
            "prompts need a corpus (config: retrieval: {corpus: FILE}; grpolab eval: --rag-corpus FILE)"
        )
    if retrieval is not None and not has_context:
        raise TemplateError(f"retrieval is set but prompt template {template.name!r} has no {{context}} placeholder "
                            "for the passages (e.g. prompt_template: rag_compact)")
    return retrieval_template(template, retrieval) if has_context else template


def template_and_reward(task, prompt_template: str | None, reward: Any, retrieval: dict | None = None, *,
                        tokenizer=None, system_prompt: str | None = None) -> tuple[Any, Any]:
    """The prompt template (``prompt_template_for``) and reward: the one given, else the embedded
    task's own, else r1_zero — under ``chat_r1``, their lenient form (any whitespace between
    ``</think>`` and ``<answer>``: a chat model's line breaks are not a format failure)."""
    template = prompt_template_for(task, prompt_template, retrieval, tokenizer=tokenizer, system_prompt=system_prompt,
                                   reward=reward)
    return template, build_reward(reward) if reward is not None else task_reward(task, template)


def task_reward(task, template) -> Any:
    """The embedded task's own reward, else r1_zero; in its lenient form under ``chat_r1``; a
    reasoning-gym task's whole-response form under a template that asks for no ``<answer>`` tags."""
    fn = task.reward_fn if task is not None else build_reward("r1_zero")
    text = getattr(template, "text", "<answer>")
    if hasattr(task, "whole_response_reward_fn") and "<answer>" not in text and "<think>" not in text:
        return task.whole_response_reward_fn
    return lenient_reward(fn) if getattr(template, "lenient_format", False) else fn


def task_or_file(source: str, n: int | None, *, seed: int = 0, split: str = "test", prompt_template: str | None = None,
                 reward: Any = None, task_options: dict | None = None, retrieval: dict | None = None,
                 tokenizer=None, system_prompt: str | None = None, **data_kw) -> tuple[list[Example], Any, Any]:
    """``task:NAME`` (an embedded task's ``split``), ``rg:NAME`` (a reasoning-gym generator's),
    ``vf:SPEC`` (a verifiers environment's, ``task_options`` its ``load_environment`` arguments) or a
    data file -> (examples[:n], template, reward). ``n`` None: every row of a file or a verifiers
    dataset, 200 of a generated task."""
    name = source[5:] if source.startswith("task:") else source if source.startswith("rg:") else None
    if source.startswith("vf:"):
        task = VerifiersTask(source[3:], task_options, seed=seed)
        n = task.size(split) if n is None else min(n, task.size(split))  # a fixed dataset: its rows, up to n
    else:
        task = get_task(name, seed=seed, options=task_options) if name is not None else None
        n = 200 if n is None and task is not None else n  # a generated task has no end
    examples = task.examples(split, n) if task is not None else \
        list(load_examples(source, **data_kw, split="train" if split == "train" else None))[:n]
    return (examples, *template_and_reward(task, prompt_template, reward, retrieval, tokenizer=tokenizer,
                                           system_prompt=system_prompt))


def run_task(cfg):
    """The config's task: a verifiers environment (``env.verifiers``), an embedded or reasoning-gym
    task (``task``), or None (``train_data``)."""
    env = getattr(cfg, "env", None) or {}
    if env.get("verifiers"):
        return VerifiersTask(env["verifiers"], env.get("args") or {}, seed=cfg.seed)
    return get_task(cfg.task, seed=cfg.seed, options=cfg.task_options) if cfg.task is not None else None


def warn_no_eval_data(train_data) -> list:
    """No validation set: said once on stderr (no eval/* curve otherwise, and no error); returns []."""
    print(f"grpolab: warning: train_data {train_data} comes without eval_data: no validation (no eval/* "
          "metrics); set eval_data (a file, or hf:NAME, which reads its test or validation split)", file=sys.stderr)
    return []


def load_inputs(cfg, tokenizer=None) -> Inputs:
    """The examples, template and reward of a config with the shared data fields; ``tokenizer``
    (else the model directory's) renders chat prompts."""
    task = run_task(cfg)
    if isinstance(task, VerifiersTask) and "task_train_size" not in cfg.model_fields_set and task.size("train"):
        # an environment's own dataset sets the run's size: its train rows, up to the default (a 65-row
        # environment was refused for the default 2000); written to the run's config.yaml, so a resume agrees
        cfg.task_train_size = min(cfg.task_train_size, task.size("train"))
    train = (task.examples("train", cfg.task_train_size)
             if task is not None
             else load_examples(cfg.train_data, **data_options(cfg)))
    if cfg.eval_data:
        evals = load_examples(cfg.eval_data, **data_options(cfg), split=None)  # hf: its test/validation split
    elif isinstance(task, VerifiersTask):  # a fixed evaluation set: its rows, up to eval_examples (as eval_data's)
        evals = task.examples("validation", min(cfg.eval_examples, task.size("validation")))
    else:
        evals = task.examples("validation", cfg.eval_examples) if task is not None else []
    if task is None and not cfg.eval_data:
        warn_no_eval_data(cfg.train_data)
    if not train:
        raise DataError(f"{cfg.train_data or getattr(task, 'name', None) or cfg.task}: no training examples")
    template, reward = template_and_reward(task, cfg.prompt_template, cfg.reward, cfg.retrieval,
                                           **prompt_options(cfg, tokenizer))
    # held-out accuracy is the task verifier's, not a reward model's (which may be hacked)
    eval_reward = task_reward(task, template) if task is not None and has_reward_model(reward) else None
    return Inputs(list(train), list(evals)[: cfg.eval_examples], template, reward, eval_reward)


def prompt_options(cfg, tokenizer=None) -> dict:
    """``tokenizer`` and ``system_prompt`` keywords of ``prompt_template_for`` for a config."""
    return {"tokenizer": tokenizer_for_prompts(cfg.model, tokenizer, cfg.trust_remote_code),
            "system_prompt": cfg.system_prompt}


def fitting_indices(sizes: list[tuple[int, str]], sources: list, limit: int | None, on_error: str,
                    what: str) -> list[int]:
    """The indices of the sequences (``sizes``: each one's token count and how it is made up, e.g.
    ``"prompt 12 + response 30"``) that fit a context of ``limit`` tokens. A longer one is an error
    naming where it came from (``file:line``) and its lengths, or — with ``data_on_error: skip`` —
    dropped, counted and reported once on stderr (as GRPO's prompts)."""
    if limit is None:
        return list(range(len(sizes)))
    kept, dropped = [], []
    for i, ((n, parts), where) in enumerate(zip(sizes, sources)):
        if n <= limit:
            kept.append(i)
            continue
        dropped.append(f"{where or f'{what} {i}'}: the {what} is {n} tokens ({parts}), past the model's context of "
                       f"{limit} tokens")
        if on_error != "skip":
            raise DataError(dropped[0] + " (shorten it, or set data_on_error: skip)")
    if dropped and not kept:
        raise DataError(f"no {what} fits the model's context of {limit} tokens: {dropped[0]}")
    if dropped:
        print(f"grpolab: skipped {len(dropped)} {what}(s) that do not fit the context; first: {dropped[0]}",
              file=sys.stderr)
    return kept


def looks_like_sft_pairs(path: str) -> bool:
    """A JSONL whose first record is an SFT pair: ``prompt`` and ``response`` (CS336's
    ``sft.jsonl``), ``prompt`` and ``completion``, or ``messages`` (TRL's formats)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(obj, dict) and (("prompt" in obj and ("response" in obj or "completion" in obj))
                                                  or ("messages" in obj and "answer" not in obj))
    return False


def load_sft_inputs(cfg, tokenizer=None) -> tuple[list[SFTPair], Inputs]:
    """SFT's (prompt, response) pairs — from an SFT JSONL (``{prompt, response}``, ``{prompt,
    completion}``, ``{messages}``) or the worked solutions of a task or GSM8K/MATH file — and the
    usual inputs for validation. A pair's text prompt that already holds the template (CS336's
    ``sft.jsonl``: r1_zero prompts; ``holds_template``) is used verbatim; without ``prompt_template``,
    the built-in template every text prompt holds (``held_template``) is the run's, so validation
    formats its questions with it too (said in one line). Another text prompt is used verbatim unless
    ``prompt_template`` is given, which then formats it as a question; a conversation is rendered by
    the chat template."""
    if cfg.train_data is not None and looks_like_sft_pairs(cfg.train_data):
        pairs = list(load_sft_pairs(cfg.train_data))
        evals = list(load_examples(cfg.eval_data, **data_options(cfg), split=None))[: cfg.eval_examples] \
            if cfg.eval_data else warn_no_eval_data(cfg.train_data)
        texts = [p.prompt for p in pairs if p.messages is None]
        name = cfg.prompt_template or held_template(texts)
        options = prompt_options(cfg, tokenizer)
        inputs = Inputs(pairs, evals, *template_and_reward(None, name, cfg.reward, cfg.retrieval, **options))
        held = 0
        for p in pairs:
            if p.messages is not None:
                p.messages = sft_conversation(p, inputs.template, named=cfg.prompt_template is not None)
                p.prompt = p.messages[: next(i for i, m in enumerate(p.messages) if m["role"] == "assistant")]
            elif holds_template(inputs.template, p.prompt):
                held += 1  # formatted already: used as it is, not formatted twice
            elif cfg.prompt_template is not None or not isinstance(p.prompt, str):
                p.prompt = inputs.template.format(p.prompt)
        if held and os.environ.get("RANK", "0") == "0":
            why = "prompt_template" if cfg.prompt_template else "detected: prompt_template not set"
            print(f"grpolab sft: {held} of {len(texts)} prompts of {cfg.train_data} already hold the "
                  f"{name} template ({why}): used as they are, not formatted again; validation "
                  f"formats its questions with {name}", file=sys.stderr)
        return pairs, inputs
    inputs = load_inputs(cfg, tokenizer)
    missing = [i for i, e in enumerate(inputs.train) if not e.solution]
    if missing:
        raise DataError(f"{cfg.train_data or cfg.task}: example {missing[0]} has no worked solution to imitate")
    return [SFTPair(inputs.template.format(e.question), e.solution, e.answer, source=e.meta.get("source"))
            for e in inputs.train], inputs


def sft_conversation(pair: SFTPair, template, named: bool) -> list[dict]:
    """A ``{messages}`` pair's conversation as the run renders its prompts: the system prompt put
    first unless it has its own (as for every conversation). A preset named in the config that
    writes into the exchange (``chat_r1``: an instruction around the question, ``<think>`` opening
    the answer) is refused: a conversation is trained as it is (TRL's way), and which of its turns
    the instruction and the prefill would go into has no one answer."""
    if named and getattr(template, "adds_to_questions", False):
        raise DataError(f"{pair.source}: prompt_template {template.name!r} wraps a question in its instruction and "
                        "opens the answer with its prefill, but a {messages} conversation is trained as it is: "
                        "leave prompt_template unset (or chat), or give {prompt, completion} pairs")
    with_system = getattr(template, "with_system", None)
    return with_system(pair.messages) if with_system is not None else pair.messages


def task_preference_pairs(
    task_name: str, split: str, n: int, seed: int, options: dict, template
) -> list[PreferencePair]:
    """(prompt, a correct worked solution, the same solution with a wrong final answer) for ``n``
    questions of an embedded task's split."""
    task = get_task(task_name, seed=seed, options={**options, "wrong_fraction": 0.0})
    rng = random.Random(f"pairs:{seed}:{split}")
    return [PreferencePair(template.format(e.question), e.solution, task.wrong_solution(e, rng),
                           source=e.meta.get("source"), question=e.question)
            for e in task.examples(split, n)]


def templated_preference_prompts(cfg, pairs: list[PreferencePair], tokenizer=None) -> list[PreferencePair]:
    """A preference file's prompts as the run renders every other prompt, when ``prompt_template``
    or ``system_prompt`` is set: through the run's template (``chat`` when only a system prompt is
    given; a conversation gets the system prompt first unless it has its own). Neither set: as
    given (DPO renders a conversation with the chat template when the pair is scored)."""
    if cfg.prompt_template is None and cfg.system_prompt is None:
        return pairs
    if getattr(cfg, "use_alpaca_template", False):
        raise TemplateError("use_alpaca_template and prompt_template/system_prompt are two prompt formats; choose one")
    template = prompt_template_for(None, cfg.prompt_template or "chat", cfg.retrieval, **prompt_options(cfg, tokenizer))
    for pair in pairs:
        try:
            pair.prompt = template.format(pair.prompt)
        except TemplateError as exc:
            raise TemplateError(f"{pair.source}: {exc}" if pair.source else str(exc)) from None
    return pairs


def load_preference_inputs(cfg, tokenizer=None, render_prompts: bool = False
                           ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """DPO's (training pairs, held-out pairs): from an embedded task, or a preference JSONL with a
    held-out file or a seeded 10 % split (a conversational prompt is rendered by the chat
    template when the pair is scored; ``render_prompts``: a file's prompts through the run's
    template, ``templated_preference_prompts``)."""
    if cfg.task is not None:
        task = get_task(cfg.task, seed=cfg.seed, options=cfg.task_options)
        template = prompt_template_for(task, cfg.prompt_template, cfg.retrieval, **prompt_options(cfg, tokenizer))
        train = task_preference_pairs(cfg.task, "train", cfg.task_train_size, cfg.seed, cfg.task_options, template)
        held = task_preference_pairs(cfg.task, "validation", cfg.eval_pairs, cfg.seed, cfg.task_options, template)
        return train, held
    pairs = list(load_preferences(cfg.train_data))
    if cfg.eval_data:
        train, held = pairs, list(load_preferences(cfg.eval_data))[: cfg.eval_pairs]
    else:
        rng = random.Random(cfg.seed)
        rng.shuffle(pairs)
        n_held = max(1, len(pairs) // 10)
        train, held = pairs[n_held:], pairs[:n_held][: cfg.eval_pairs]
    if render_prompts:
        train, held = (templated_preference_prompts(cfg, part, tokenizer) for part in (train, held))
    return train, held
