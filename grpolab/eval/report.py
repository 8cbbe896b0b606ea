"""``grpolab eval``: accuracy, format rate, pass@k, maj@k, consistency, diversity, perplexity,
token entropy and lengths of a model on held-out questions, as JSON plus a readable table."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..data import DataError
from ..data.datasets import read_jsonl_records, require_field
from ..rewards import (
    RewardScorer,
    extract_r1_zero_answer,
    last_boxed,
    last_number,
    normalize_answer,
)
from ..rollout import SamplingParams
from .evaluation import EvalResult, evaluate
from .generations import token_entropies
from .metrics import (
    check_perplexity_args,
    distinct_n,
    majority_vote,
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
        text = "\n\n".join(read_jsonl_records(path, lambda obj: str(require_field(obj, text_field))))
    else:
        text = Path(path).read_text(encoding="utf-8")
    return tokenizer(text[:max_chars], add_special_tokens=False)["input_ids"]


def check_eval_inputs(
    k: int,
    examples: Sequence,
    source: str | None = None,
    corpus_ids: Sequence[int] | None = None,
    ppl_max_length: int = 512,
    ppl_stride: int = 256,
) -> None:
    """The input errors of ``evaluate_model`` as one-line ValueErrors, before any sampling."""
    if k < 1:
        raise ValueError(f"--k (samples per question) must be at least 1, got {k}")
    if not examples:
        raise ValueError(f"no questions to evaluate in {source}" if source else "no questions to evaluate")
    if corpus_ids is not None:
        check_perplexity_args(len(corpus_ids), ppl_max_length, ppl_stride)


def sample_metrics(result: EvalResult, keys: Sequence[str | None], questions: int, k: int) -> dict[str, float]:
    """pass@k, pass@1, maj@k, consistency and diversity over ``k`` samples for each question;
    maj@k, consistency and distinct answers share one grouping of the answers (by equivalence).
    Without a verifier (``result.correct`` None: a reward model alone) no pass@k or maj@k."""
    per_q: list[list[int]] = [[] for _ in range(questions)]
    for i, r in enumerate(result.rollouts):
        per_q[r.prompt_index].append(i)
    correct = result.correct if result.correct is not None else [False] * len(result.rollouts)
    votes = [majority_vote([keys[i] for i in idx], [correct[i] for i in idx]) for idx in per_q]
    n_right = [sum(correct[i] for i in idx) for idx in per_q]
    ids = [r.response_ids for r in result.rollouts]
    verified = {
        f"pass@{k}": sum(pass_at_k(k, c, k) for c in n_right) / questions,
        "pass@1": sum(pass_at_k(k, c, 1) for c in n_right) / questions,
        f"maj@{k}": sum(v.maj for v in votes) / questions,
    } if result.correct is not None else {}
    return {
        **verified,
        "consistency": sum(v.consistency for v in votes) / questions,
        "distinct_1": distinct_n(ids, 1),
        "distinct_2": distinct_n(ids, 2),
        "distinct_answers_per_question": sum(v.distinct for v in votes) / questions,
    }


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
    *,
    reward_timeout_s: float = 10.0,
    scorer: RewardScorer | None = None,
    source: str | None = None,
    entropy: bool = True,
    top_p: float = 1.0,
) -> tuple[dict[str, Any], list[dict]]:
    """All figures for ``k`` samples per question. Returns (metrics, generations).

    Input errors (``k < 1``, no examples — ``source`` names where they came from — a corpus too
    short for perplexity) raise ValueError before any sampling. Rewards are guarded (see
    ``evaluate``); token entropy (``entropy``) is of the sampling distribution (``temperature``)."""
    check_eval_inputs(k, examples, source, corpus_ids, ppl_max_length, ppl_stride)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, min_tokens=min_tokens,
                              stop=list(stop), seed=seed)
    result = evaluate(backend, examples, template, reward_fn, sampling, n=k, scorer=scorer,
                      reward_timeout_s=reward_timeout_s)
    keys = [answer_key(r.scored_response) for r in result.rollouts]
    m = {**result.metrics, "k": k, "questions": len(examples), **sample_metrics(result, keys, len(examples), k)}
    if entropy:  # a second pass over every response: optional (grpolab eval --no-entropy)
        entropies = token_entropies(model, result.rollouts, tokenizer, temperature=temperature)
        m["token_entropy"] = sum(entropies) / max(1, len(entropies))
    if corpus_ids is not None:
        m["perplexity"] = perplexity(model, corpus_ids, ppl_max_length, ppl_stride)
    m.update(rollout_info_means(result.rollouts))
    generations = [{"question": examples[r.prompt_index].question, "prompt": r.prompt, "response": r.response,
                    "ground_truth": result.ground_truths[i], "answer": keys[i], **result.scores[i],
                    "length": len(r.response_ids), "finish_reason": r.finish_reason, **r.info}
                   for i, r in enumerate(result.rollouts)]
    return m, generations


def rollout_info_means(rollouts) -> dict[str, float]:
    """Multi-turn rollouts (a tool environment): the mean of each per-rollout figure (tool calls,
    errors, turns, observation and model tokens) and the share of answers that called a tool."""
    infos = [r.info for r in rollouts if r.info]
    if not infos:
        return {}
    out = {f"mean_{k}": sum(i.get(k, 0) for i in infos) / len(rollouts) for k in sorted(infos[0])}
    out["tool_call_rate"] = sum(i.get("tool_calls", 0) > 0 for i in infos) / len(rollouts)
    return out


def format_table(metrics: dict[str, Any]) -> str:
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in metrics.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def check_writable(out: Path) -> None:
    """Make ``out`` a directory and prove a file can be written there, or raise
    ``ValueError("cannot write to <out>: <reason>")``. Call it before sampling: a bad ``--out``
    then fails in a second, not after the whole evaluation."""
    out = Path(out)
    blocker = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        where = "it" if blocker == out else str(blocker)
        raise ValueError(f"cannot write to {out}: {where} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(f"cannot write to {out}: {exc.strerror or exc}") from None


def write_report(out_dir: Path, metrics: dict, generations: list[dict]) -> None:
    """``eval.json``, then ``generations.jsonl``, in ``out_dir``: each written whole or not at all (a temporary
    file renamed into place). ``ValueError`` naming the file when one cannot be written (not a directory,
    no permission, a full disk): one line, and no half-written file."""
    out_dir = Path(out_dir)
    check_writable(out_dir)
    write_atomically(out_dir / "eval.json", [json.dumps(metrics, indent=2)])
    write_atomically(out_dir / "generations.jsonl", (json.dumps(g) + "\n" for g in generations))


def write_atomically(path: Path, chunks: Iterable[str]) -> None:
    """``chunks`` as the text of ``path``, through ``.<name>.tmp`` beside it (removed when writing fails)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None
