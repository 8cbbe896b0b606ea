"""``grpolab eval``: accuracy, format rate, pass@k, maj@k, consistency, diversity, perplexity,
token entropy and lengths of a model on held-out questions, as JSON plus a readable table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..rewards import (
    extract_r1_zero_answer,
    last_boxed,
    last_number,
    normalize_answer,
)
from ..rollout import SamplingParams
from . import evaluate, token_entropies
from .metrics import (
    consistency,
    distinct_n,
    maj_at_k,
    mean_distinct_answers,
    pass_at_k,
    perplexity,
)


def answer_key(response: str) -> str | None:
    """A canonical answer string for agreement counting: the R1-Zero answer block (any
    whitespace), else the last ``\\boxed{}``, else the last number; None when there is none."""
    answer = extract_r1_zero_answer(response, lenient_format=True)
    if answer is None:
        answer = last_boxed(response) or last_number(response)
    if answer is None:
        return None
    boxed = last_boxed(answer)
    key = normalize_answer(boxed if boxed is not None else answer)
    return key or None


def corpus_token_ids(path: str, tokenizer, text_field: str = "text", max_chars: int = 2_000_000) -> list[int]:
    """Token ids of a text corpus: a plain text file, a JSONL file (``text_field``), or
    ``hf:NAME[:CONFIG]`` through ``datasets`` (its test split; e.g.
    ``hf:Salesforce/wikitext:wikitext-103-raw-v1``). Documents are joined with blank lines."""
    if path.startswith("hf:"):
        from ..data import DataError

        try:
            import datasets
        except ImportError:
            raise DataError(f"corpus {path!r}: the 'datasets' library is not installed") from None
        name, _, config = path[3:].partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split="test")
        except Exception as exc:  # noqa: BLE001
            raise DataError(f"corpus {path!r} could not be loaded: {type(exc).__name__}: {exc}") from None
        text = "\n\n".join(row[text_field] for row in ds)
    elif path.endswith(".jsonl"):
        from ..data.datasets import _require, read_jsonl_records

        text = "\n\n".join(read_jsonl_records(path, lambda obj: str(_require(obj, text_field))))
    else:
        text = Path(path).read_text(encoding="utf-8")
    return tokenizer(text[:max_chars], add_special_tokens=False)["input_ids"]


def evaluate_model(
    model,
    tokenizer,
    backend,
    examples: Sequence,
    template,
    reward_fn,
    k: int = 4,
    temperature: float = 1.0,
    max_tokens: int = 1024,
    min_tokens: int = 0,
    stop: Sequence[str] = ("</answer>",),
    seed: int = 0,
    corpus_ids: Sequence[int] | None = None,
    ppl_max_length: int = 512,
    ppl_stride: int = 256,
) -> tuple[dict[str, Any], list[dict]]:
    """All figures for ``k`` samples per question. Returns (metrics, generations)."""
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, min_tokens=min_tokens, stop=list(stop), seed=seed)
    result = evaluate(backend, examples, template, reward_fn, sampling, n=k)
    per_q: list[list[int]] = [[] for _ in examples]
    for i, r in enumerate(result.rollouts):
        per_q[r.prompt_index].append(i)
    keys = [answer_key(r.response) for r in result.rollouts]
    correct = [s["reward"] >= 1.0 for s in result.scores]
    groups = [[keys[i] for i in idx] for idx in per_q]
    m = dict(result.metrics)
    m.update({
        "k": k,
        "questions": len(examples),
        f"pass@{k}": sum(pass_at_k(k, sum(correct[i] for i in idx), k) for idx in per_q) / len(per_q),
        "pass@1": sum(pass_at_k(k, sum(correct[i] for i in idx), 1) for idx in per_q) / len(per_q),
        f"maj@{k}": sum(maj_at_k(g, [correct[i] for i in idx]) for g, idx in zip(groups, per_q)) / len(per_q),
        "consistency": sum(consistency(g) for g in groups) / len(groups),
        "distinct_1": distinct_n([r.response_ids for r in result.rollouts], 1),
        "distinct_2": distinct_n([r.response_ids for r in result.rollouts], 2),
        "distinct_answers_per_question": mean_distinct_answers(groups),
    })
    entropies = token_entropies(model, result.rollouts, tokenizer)
    m["token_entropy"] = sum(entropies) / max(1, len(entropies))
    if corpus_ids is not None:
        m["perplexity"] = perplexity(model, corpus_ids, ppl_max_length, ppl_stride)
    generations = [{"question": examples[r.prompt_index].question, "prompt": r.prompt, "response": r.response,
                    "ground_truth": result.ground_truths[i], "answer": keys[i], **result.scores[i],
                    "length": len(r.response_ids), "finish_reason": r.finish_reason}
                   for i, r in enumerate(result.rollouts)]
    return m, generations


def format_table(metrics: dict[str, Any]) -> str:
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in metrics.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_report(out_dir: Path, metrics: dict, generations: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(metrics, indent=2))
    with open(out_dir / "generations.jsonl", "w", encoding="utf-8") as f:
        for g in generations:
            f.write(json.dumps(g) + "\n")
