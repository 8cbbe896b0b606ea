"""Per-token records of a few sampled groups per step, for ``grpolab view``.

Each GRPO/PPO step writes one JSON line per recorded group to ``tokens.jsonl`` beside
``metrics.jsonl``: the prompt, and per response its reward components, finish reason, advantage
(the signal the loss multiplied the response by: the raw reward under ``no_baseline``) and, per
response token (column-wise lists, floats rounded to 4 digits, null where unknown): the token's
text, the sampler's and the trainer's log-probs, the entropy, the ratio to the old policy the loss
weighed (GSPO's: the sequence ratio, at every token of the response) and whether its clip acted,
and whether it is an observation token (tools). Only figures the step
computed anyway are kept (nothing is recomputed): a row the update skipped (zero advantage) has no
trainer figures. ``token_record_groups`` groups per step (0: nothing recorded, no cost); which
groups is drawn from its own seeded stream, so recording never changes a run's numbers.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from .run_dir import RECORDS_FILE

STAT_KEYS = ("entropy", "ratio", "clipped")  # what the policy update fills in (grpo_update.accumulate_policy_gradient)


def empty_stats(shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Label-layout tensors for the update's per-token figures; NaN where a token was not trained."""
    return {key: torch.full(shape, float("nan")) for key in STAT_KEYS}


def _round1(value: float) -> float | None:
    """``value`` to 4 places; None (JSON null) for Infinity and NaN, which JSON has no spelling for."""
    return round(value, 4) if math.isfinite(value) else None


def _round(values: list[float]) -> list[float | None]:
    return [_round1(v) for v in values]


class TokenRecorder:
    """Writes ``run_dir/tokens.jsonl`` (rank 0 only). A fresh run starts it empty; a resumed run
    keeps the records of the steps before the checkpoint it resumed from."""

    def __init__(self, run_dir: Path, groups: int, seed: int, *, resume_step: int | None = None, enabled: bool = True):
        self.groups, self.seed = groups if enabled else 0, seed
        self.path = Path(run_dir) / RECORDS_FILE
        if not enabled:
            return
        if resume_step is None:  # a fresh run: no records of an earlier run in this directory
            self.path.write_text("", encoding="utf-8") if groups else self.path.unlink(missing_ok=True)
        elif self.path.exists():  # resumed: the steps after the checkpoint are run again
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line)["step"] < resume_step]
            self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def pick(self, n_groups: int, step: int) -> list[int]:
        """The groups recorded at ``step``: drawn by their own generator (never the run's)."""
        rng = random.Random(self.seed * 1_000_003 + step)
        return sorted(rng.sample(range(n_groups), min(self.groups, n_groups)))

    def record(self, step: int, rollouts, scores: list[dict], group_size: int, tokenizer, per_token: dict,
               advantages: torch.Tensor, examples: list | None = None) -> None:
        """Append the picked groups of one step. ``per_token``: label-layout (batch, seq) tensors
        (``sampler_lp``, ``trainer_lp``, ``entropy``, ``ratio``, ``clipped``; NaN = unknown);
        ``advantages``: (batch,) per response or (batch, seq) per token (PPO's GAE)."""
        if not self.groups:
            return
        lines = []
        for g in self.pick(len(rollouts) // group_size, step):
            rows = range(g * group_size, (g + 1) * group_size)
            first = rollouts[rows[0]]
            answer = None
            if examples is not None and first.prompt_index < len(examples):
                answer = getattr(examples[first.prompt_index], "answer", None)
            lines.append(json.dumps({
                "step": step, "group": g, "prompt": first.prompt, "answer": None if answer is None else str(answer),
                "responses": [self._response(rollouts[i], scores[i], i, tokenizer, per_token, advantages)
                              for i in rows],
            }, separators=(",", ":")))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))

    @staticmethod
    def _response(rollout, score: dict, row: int, tokenizer, per_token: dict, advantages: torch.Tensor) -> dict:
        n = len(rollout.response_ids)
        start = len(rollout.prompt_ids) - 1  # label layout: position t predicts token t + 1
        out = {"reward": _round1(float(score.get("reward", 0.0))),
               "rewards": {k: _round1(float(v)) for k, v in score.items() if isinstance(v, (int, float))},
               "finish": rollout.finish_reason, "text": rollout.response,
               "tokens": tokenizer.batch_decode([[i] for i in rollout.response_ids], skip_special_tokens=False)}
        if advantages.dim() == 1:
            out["advantage"] = _round1(float(advantages[row]))
        else:
            out["advantage"] = _round(advantages[row, start : start + n].tolist())
        for key, values in per_token.items():
            out[key] = _round(values[row, start : start + n].float().tolist())
        if rollout.loss_mask is not None:
            out["obs"] = [0 if sampled else 1 for sampled in rollout.loss_mask]
        if rollout.info:
            out["info"] = {k: v for k, v in rollout.info.items() if isinstance(v, (int, float, str))}
        return out


def sampler_log_probs(rollouts, shape: tuple[int, ...]) -> torch.Tensor:
    """The sampler's log-probs of the rollouts' tokens in label layout (``batching.make_rollout_batch``
    keeps them in its batch; PPO builds plain sequences)."""
    out = torch.full(shape, float("nan"))
    for i, r in enumerate(rollouts):
        start = len(r.prompt_ids) - 1
        out[i, start : start + len(r.logprobs)] = torch.tensor(r.logprobs)
    return out

