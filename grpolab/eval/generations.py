"""Per-response token entropies and ``log_generations`` (CS336 §4.2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..core import build_sequences, pack_rows, pad_token_id
from ..models.fused_head import response_log_probs
from ..rollout import Rollout
from .evaluation import EvalResult
from .mode import eval_mode


def token_entropies(
    model,
    rollouts: Sequence[Rollout],
    tokenizer,
    batch_size: int = 64,
    *,
    temperature: float = 1.0,
    token_budget: int | None = None,
) -> list[float]:
    """Mean per-token entropy of each response under ``model`` at the sampling ``temperature``
    (the distribution the tokens were drawn from: logits / temperature; temperature 0, greedy,
    reports the untempered distribution). Dropout is off during the forwards.

    A forward takes at most ``batch_size`` rows and ``token_budget`` padded tokens (default
    ``core.logprobs.INFERENCE_TOKEN_BUDGET``), and ``response_log_probs`` computes the logits a
    chunk of positions at a time, so memory does not grow with the number of rollouts."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scale = temperature if temperature > 0 else 1.0
    out: list[float] = []
    pad = pad_token_id(tokenizer)
    with eval_mode(model):
        device = next(model.parameters()).device
        for i in range(0, len(rollouts), batch_size):
            chunk = rollouts[i : i + batch_size]
            lengths = [len(r.prompt_ids) + len(r.response_ids) - 1 for r in chunk]
            for group in pack_rows(lengths, token_budget):
                rows = [chunk[j] for j in group]
                if not any(r.response_ids for r in rows):
                    out.extend(0.0 for _ in rows)
                    continue
                seq = build_sequences([r.prompt_ids for r in rows], [r.response_ids for r in rows], pad)
                ent = response_log_probs(model, seq["input_ids"].to(device), seq["labels"].to(device),
                                         return_token_entropy=True, temperature=scale)["token_entropy"]
                ent = ent.float().cpu()
                mask = seq["response_mask"]
                for row in range(len(rows)):
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
    """Write sample generations (prompt, response, ground truth, rewards, mean token entropy at the
    sampling temperature, length) as JSONL and return summary figures (CS336 §4.2 ``log_generations``)."""
    k = min(max_samples, len(result.rollouts))
    rollouts = result.rollouts[:k]
    temperature = result.sampling.temperature if result.sampling is not None else 1.0
    entropies = (token_entropies(model, rollouts, tokenizer, temperature=temperature)
                 if model is not None and k else [None] * k)
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
