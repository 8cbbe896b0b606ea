"""What a run trains and validates on: one place that turns a config's data fields (``task`` or
``train_data``, ``eval_data``, ``prompt_template``, ``reward``) into examples, a prompt template
and a reward function — for every trainer and for ``grpolab eval``."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from ..data import (
    DataError,
    Example,
    PreferencePair,
    SFTPair,
    get_task,
    load_examples,
    load_preferences,
    load_sft_pairs,
    TemplateError,
    load_template,
)
from ..envs import retrieval_template
from ..rewards import build_reward


@dataclass
class Inputs:
    """Training examples, validation examples, the prompt template and the reward function."""

    train: list
    evals: list
    template: Any
    reward: Any


def data_options(cfg) -> dict:
    """The data-file settings of a config, as ``load_examples`` keywords."""
    return {"format": cfg.data_format, "question_field": cfg.question_field, "answer_field": cfg.answer_field,
            "on_error": cfg.data_on_error}


def prompt_template_for(task, prompt_template: str | None, retrieval: dict | None = None):
    """The prompt template given, else the embedded task's own, else r1_zero; a template with a
    ``{context}`` placeholder gets the top passages of the ``retrieval`` corpus for each question
    (retrieval-augmented prompts) and is refused without one, as ``retrieval`` is without it."""
    template = load_template(prompt_template or (task.default_template if task is not None else "r1_zero"))
    has_context = "{context}" in template.text
    if has_context and retrieval is None:
        raise TemplateError(f"prompt template {template.name!r} has a {{context}} placeholder: retrieval-augmented "
                            "prompts need a corpus (config: retrieval: {corpus: FILE}; grpolab eval: --rag-corpus FILE)")
    if retrieval is not None and not has_context:
        raise TemplateError(f"retrieval is set but prompt template {template.name!r} has no {{context}} placeholder "
                            "for the passages (e.g. prompt_template: rag_compact)")
    return retrieval_template(template, retrieval) if has_context else template


def template_and_reward(task, prompt_template: str | None, reward: Any, retrieval: dict | None = None) -> tuple[Any, Any]:
    """The prompt template (``prompt_template_for``) and reward: the one given, else the embedded
    task's own, else r1_zero."""
    template = prompt_template_for(task, prompt_template, retrieval)
    if reward is not None:
        return template, build_reward(reward)
    return template, task.reward_fn if task is not None else build_reward("r1_zero")


def task_or_file(source: str, n: int, *, seed: int = 0, split: str = "test", prompt_template: str | None = None,
                 reward: Any = None, task_options: dict | None = None, retrieval: dict | None = None,
                 **data_kw) -> tuple[list[Example], Any, Any]:
    """``task:NAME`` (an embedded task's ``split``) or a data file -> (examples[:n], template, reward)."""
    task = get_task(source[5:], seed=seed, **(task_options or {})) if source.startswith("task:") else None
    examples = task.examples(split, n) if task is not None else list(load_examples(source, **data_kw))[:n]
    return (examples, *template_and_reward(task, prompt_template, reward, retrieval))


def load_inputs(cfg) -> Inputs:
    """The examples, template and reward of a config with the shared data fields."""
    task = get_task(cfg.task, seed=cfg.seed, **cfg.task_options) if cfg.task is not None else None
    train = task.examples("train", cfg.task_train_size) if task is not None else load_examples(cfg.train_data, **data_options(cfg))
    if cfg.eval_data:
        evals = load_examples(cfg.eval_data, **data_options(cfg))
    else:
        evals = task.examples("validation", cfg.eval_examples) if task is not None else []
    if not train:
        raise DataError(f"{cfg.train_data or cfg.task}: no training examples")
    template, reward = template_and_reward(task, cfg.prompt_template, cfg.reward, cfg.retrieval)
    return Inputs(list(train), list(evals)[: cfg.eval_examples], template, reward)


def looks_like_sft_pairs(path: str) -> bool:
    """A JSONL whose first record has ``prompt`` and ``response`` (CS336's ``sft.jsonl``)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(obj, dict) and "prompt" in obj and "response" in obj
    return False


def load_sft_inputs(cfg) -> tuple[list[SFTPair], Inputs]:
    """SFT's (prompt, response) pairs — from an ``sft.jsonl`` or the worked solutions of a task or
    GSM8K/MATH file — and the usual inputs for validation."""
    if cfg.train_data is not None and looks_like_sft_pairs(cfg.train_data):
        pairs = list(load_sft_pairs(cfg.train_data))
        evals = list(load_examples(cfg.eval_data, **data_options(cfg)))[: cfg.eval_examples] if cfg.eval_data else []
        inputs = Inputs(pairs, evals, *template_and_reward(None, cfg.prompt_template, cfg.reward, cfg.retrieval))
        return pairs, inputs
    inputs = load_inputs(cfg)
    missing = [i for i, e in enumerate(inputs.train) if not e.solution]
    if missing:
        raise DataError(f"{cfg.train_data or cfg.task}: example {missing[0]} has no worked solution to imitate")
    return [SFTPair(inputs.template.format(e.question), e.solution, e.answer) for e in inputs.train], inputs


def task_preference_pairs(task_name: str, split: str, n: int, seed: int, options: dict, template) -> list[PreferencePair]:
    """(prompt, a correct worked solution, the same solution with a wrong final answer) for ``n``
    questions of an embedded task's split."""
    task = get_task(task_name, seed=seed, **{**options, "wrong_fraction": 0.0})
    rng = random.Random(f"pairs:{seed}:{split}")
    return [PreferencePair(template.format(e.question), e.solution, task.wrong_solution(e, rng))
            for e in task.examples(split, n)]


def load_preference_inputs(cfg) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """DPO's (training pairs, held-out pairs): from an embedded task, or a preference JSONL with a
    held-out file or a seeded 10 % split."""
    if cfg.task is not None:
        task = get_task(cfg.task, seed=cfg.seed, **cfg.task_options)
        template = prompt_template_for(task, cfg.prompt_template, cfg.retrieval)
        train = task_preference_pairs(cfg.task, "train", cfg.task_train_size, cfg.seed, cfg.task_options, template)
        held = task_preference_pairs(cfg.task, "validation", cfg.eval_pairs, cfg.seed, cfg.task_options, template)
        return train, held
    pairs = list(load_preferences(cfg.train_data))
    if cfg.eval_data:
        return pairs, list(load_preferences(cfg.eval_data))[: cfg.eval_pairs]
    rng = random.Random(cfg.seed)
    rng.shuffle(pairs)
    n_held = max(1, len(pairs) // 10)
    return pairs[n_held:], pairs[:n_held][: cfg.eval_pairs]
