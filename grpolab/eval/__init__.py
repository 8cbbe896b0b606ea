"""Evaluation: generate for held-out questions, grade, summarise; ``log_generations`` (CS336 §4.2)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..core import build_sequences, compute_entropy, pad_token_id
from ..rewards import RewardScorer
from ..rollout import Rollout, SamplingParams


@dataclass
class EvalResult:
    metrics: dict[str, float]
    rollouts: list[Rollout]
    scores: list[dict[str, float]]
    ground_truths: list[Any]


def evaluate(
    backend,
    examples: Sequence,
    template,
    reward_fn,
    sampling: SamplingParams,
    n: int = 1,
    scorer: RewardScorer | None = None,
) -> EvalResult:
    """Answer accuracy, format rate, mean response length (all, correct, incorrect), truncation."""
    prompts = [template.format(e.question) for e in examples]
    rollouts = backend.generate(prompts, n, sampling)
    gts = [examples[r.prompt_index].answer for r in rollouts]
    scorer = scorer or RewardScorer(reward_fn, timeout_s=0)
    scores = scorer.score([r.response for r in rollouts], gts)
    total = len(rollouts)
    lengths = [len(r.response_ids) for r in rollouts]
    correct = [s["reward"] >= 1.0 for s in scores]

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else 0.0

    metrics = {
        # a right answer in the right format (the plain reward when a custom one reports no answer)
        "accuracy": mean(s.get("answer_reward", s["reward"]) * s.get("format_reward", 1.0) for s in scores),
        "reward": mean(s["reward"] for s in scores),
        "format_rate": mean(s.get("format_reward", 0.0) for s in scores),
        "mean_length": mean(lengths),
        "mean_length_correct": mean(l for l, c in zip(lengths, correct) if c),
        "mean_length_incorrect": mean(l for l, c in zip(lengths, correct) if not c),
        "truncation_rate": mean(r.finish_reason == "length" for r in rollouts),
        "n": total,
    }
    return EvalResult(metrics, rollouts, scores, gts)


def token_entropies(model, rollouts: Sequence[Rollout], tokenizer, batch_size: int = 64) -> list[float]:
    """Mean per-token entropy of each response under ``model`` (for ``log_generations``)."""
    out: list[float] = []
    pad = pad_token_id(tokenizer)
    with torch.inference_mode():
        for i in range(0, len(rollouts), batch_size):
            chunk = rollouts[i : i + batch_size]
            if not any(r.response_ids for r in chunk):
                out.extend(0.0 for _ in chunk)
                continue
            seq = build_sequences([r.prompt_ids for r in chunk], [r.response_ids for r in chunk], pad)
            device = next(model.parameters()).device
            logits = model(seq["input_ids"].to(device)).logits
            ent = compute_entropy(logits).cpu()
            mask = seq["response_mask"]
            for row in range(len(chunk)):
                n_tok = int(mask[row].sum())
                out.append(float((ent[row] * mask[row]).sum() / n_tok) if n_tok else 0.0)
    return out


def log_generations(
    path: str | Path,
    result: EvalResult,
    step: int,
    model=None,
    tokenizer=None,
    max_samples: int = 16,
) -> dict[str, float]:
    """Write sample generations (prompt, response, ground truth, rewards, mean token entropy,
    length) as JSONL and return summary figures (CS336 §4.2 ``log_generations``)."""
    k = min(max_samples, len(result.rollouts))
    rollouts = result.rollouts[:k]
    entropies = token_entropies(model, rollouts, tokenizer) if model is not None and k else [None] * k
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r, s, gt, h in zip(rollouts, result.scores, result.ground_truths, entropies):
            f.write(json.dumps({
                "step": step, "prompt": r.prompt, "response": r.response, "ground_truth": gt,
                "reward": s["reward"], "format_reward": s.get("format_reward"), "answer_reward": s.get("answer_reward"),
                "mean_token_entropy": h, "length": len(r.response_ids), "finish_reason": r.finish_reason,
            }) + "\n")
    valid = [h for h in entropies if h is not None]
    return {"mean_token_entropy": sum(valid) / len(valid) if valid else 0.0}
