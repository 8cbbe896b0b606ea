"""Rollouts from a Hugging Face causal LM with a hand-rolled sampling loop over the KV cache.

Why not ``model.generate``: we need the sampler's per-token log-probs, stop strings kept in the
output, ``min_tokens``, and exact finish reasons, with little per-step overhead. The loop:

1. left-pad the prompts and prefill each prompt once (only the last position's logits are
   computed), then repeat its KV cache ``n`` times — the group shares one prefill. For
   Llama/Qwen2-architecture models a lean forward (``fast_decoder``) replaces the Hugging Face
   forward, whose per-call overhead dominates small models; other models use the latter;
2. sample token by token (temperature, top-p; greedy at temperature 0) with an explicit
   ``torch.Generator`` so runs are reproducible and resumable;
3. drop a row from the KV cache as soon as it finishes, so long tails do not pay for finished
   sequences.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Sequence

import torch

from ..core import pad_token_id
from . import fast_decoder
from .base import Rollout, SamplingParams


class _HFEngine:
    """The Hugging Face forward with its KV cache, behind the engine interface the loop uses."""

    def __init__(self, model, cache_kw: str):
        self.model, self.cache_kw = model, cache_kw

    def _call(self, ids, last_only=False):
        kwargs = {"use_cache": True}
        if self.cache is not None:
            kwargs[self.cache_kw] = self.cache
        if last_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=self.pos, **kwargs)
        self.cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        return out.logits[:, -1, :].float()

    def prefill(self, ids, mask, max_new):
        self.cache, self.mask = None, mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.pos = positions
        logits = self._call(ids, last_only=True)
        self.pos = positions[:, -1:]
        return logits

    def repeat(self, n):
        self.cache.batch_repeat_interleave(n)
        self.mask = self.mask.repeat_interleave(n, 0)
        self.pos = self.pos.repeat_interleave(n, 0)

    def select(self, keep):
        self.cache.batch_select_indices(keep)
        self.mask, self.pos = self.mask[keep], self.pos[keep]

    def step(self, tokens):
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.pos = self.pos + 1
        return self._call(tokens.unsqueeze(-1))


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(-1)
    drop = cumulative - sorted_probs > top_p  # keep the smallest prefix whose mass reaches top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


class HFRolloutBackend:
    """``generate(prompts, n, sampling)`` on the training model itself (no weight copy to sync)."""

    def __init__(
        self,
        model,
        tokenizer,
        max_batch_size: int = 256,
        autocast_dtype: torch.dtype | None = None,
        generator: torch.Generator | None = None,
        fast_path: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.autocast_dtype = autocast_dtype
        self.generator = generator
        self.pad_id = pad_token_id(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        params = inspect.signature(model.forward).parameters
        # transformers 5 calls the cache argument ``cache``; 4.x calls it ``past_key_values``
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._stop_cache: dict[tuple[str, ...], tuple[list[int] | None, int]] = {}
        self.fast_path = fast_path
        self._fast = None

    def sync_weights(self, model) -> None:
        self.model = model

    # ---------------------------------------------------------------- helpers
    def _stop_plan(self, stops: Sequence[str]) -> tuple[list[int] | None, int]:
        """Single-token stop strings are checked by id; others by decoding a short tail."""
        key = tuple(stops)
        if key not in self._stop_cache:
            encoded = [self.tokenizer(s, add_special_tokens=False)["input_ids"] for s in stops]
            if stops and all(len(e) == 1 for e in encoded):
                self._stop_cache[key] = ([e[0] for e in encoded], 0)
            else:
                self._stop_cache[key] = (None, max((len(e) for e in encoded), default=0) + 2)
        return self._stop_cache[key]

    def _engine(self):
        if self.fast_path and fast_decoder.supports(self.model):
            if self._fast is None or self._fast.model is not self.model:
                self._fast = fast_decoder.FastDecoder(self.model)
            else:
                self._fast.refresh()  # the weights changed since the last call
            return self._fast
        return _HFEngine(self.model, self._cache_kw)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device_type = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    # ---------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams) -> list[Rollout]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        prompt_ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        generator = self.generator
        if sampling.seed is not None:
            generator = torch.Generator().manual_seed(sampling.seed)
        per_chunk = max(1, self.max_batch_size // n)
        rollouts: list[Rollout] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), self._autocast():
                for start in range(0, len(prompts), per_chunk):
                    chunk = list(range(start, min(start + per_chunk, len(prompts))))
                    rollouts.extend(self._generate_chunk(prompts, prompt_ids, chunk, n, sampling, generator))
        finally:
            self.model.train(was_training)
        return rollouts

    def _generate_chunk(self, prompts, prompt_ids, chunk, n, sampling, generator):
        device = next(self.model.parameters()).device
        lengths = [len(prompt_ids[i]) for i in chunk]
        if min(lengths) == 0:
            raise ValueError("an empty prompt cannot be continued")
        width = max(lengths)
        ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, width - lengths[row] :] = torch.tensor(prompt_ids[i])
            mask[row, width - lengths[row] :] = 1
        ids, mask = ids.to(device), mask.to(device)
        engine = self._engine()
        logits = engine.prefill(ids, mask, sampling.max_tokens)
        if n > 1:
            engine.repeat(n)
            logits = logits.repeat_interleave(n, 0)

        batch = len(chunk) * n
        max_tokens = sampling.max_tokens
        tokens = torch.full((batch, max_tokens), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros((batch, max_tokens), dtype=torch.float32)
        out_len = torch.zeros(batch, dtype=torch.long)
        reason = ["length"] * batch
        active = torch.arange(batch)  # rows of the current cache -> original rows
        stop_ids, tail = self._stop_plan(sampling.stop)
        stop_ids_t = torch.tensor(stop_ids, device=device) if stop_ids else None
        block = [self.eos_id] if self.eos_id is not None else []
        block_t = torch.tensor(block + (stop_ids or []), device=device) if block or stop_ids else None

        for t in range(max_tokens):
            logp = torch.log_softmax(logits, dim=-1)
            scores = logits
            if t < sampling.min_tokens and block_t is not None:
                scores = scores.index_fill(-1, block_t, float("-inf"))
            if sampling.temperature == 0:
                next_tok = scores.argmax(-1)
            else:
                probs = torch.softmax(scores / sampling.temperature, dim=-1)
                if sampling.top_p < 1.0:
                    probs = _top_p_filter(probs, sampling.top_p)
                next_tok = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(device)
            tok_lp = logp.gather(-1, next_tok.unsqueeze(-1)).squeeze(-1)
            rows = active
            tokens[rows, t] = next_tok.cpu()
            logprobs[rows, t] = tok_lp.float().cpu()
            out_len[rows] = t + 1

            done = torch.zeros(len(rows), dtype=torch.bool, device=device)
            if t + 1 >= sampling.min_tokens:
                if self.eos_id is not None:
                    is_eos = next_tok == self.eos_id
                    for r in is_eos.nonzero().flatten().tolist():
                        reason[rows[r]] = "eos"
                    done |= is_eos
                if stop_ids_t is not None:
                    is_stop = torch.isin(next_tok, stop_ids_t) & ~done
                    for r in is_stop.nonzero().flatten().tolist():
                        reason[rows[r]] = "stop"
                    done |= is_stop
                elif sampling.stop and t + 1 >= sampling.min_tokens:
                    for r in (~done).nonzero().flatten().tolist():
                        orig = rows[r].item()
                        text = self.tokenizer.decode(tokens[orig, max(0, t + 1 - tail) : t + 1])
                        if any(s in text for s in sampling.stop):
                            reason[orig] = "stop"
                            done[r] = True
            if t + 1 == max_tokens or bool(done.all()):
                break
            if bool(done.any()):
                # finished rows leave the cache at once: later steps only pay for live rows
                keep = (~done).nonzero().flatten()
                engine.select(keep)
                next_tok, active = next_tok[keep], active[keep.cpu()]
            logits = engine.step(next_tok)

        out = []
        for row in range(batch):
            n_tok = int(out_len[row])
            resp_ids = tokens[row, :n_tok].tolist()
            p = chunk[row // n]
            out.append(
                Rollout(
                    prompt=prompts[p],
                    response=self.tokenizer.decode(resp_ids, skip_special_tokens=True),
                    prompt_ids=list(prompt_ids[p]),
                    response_ids=resp_ids,
                    logprobs=logprobs[row, :n_tok].tolist(),
                    finish_reason=reason[row],
                    prompt_index=p,
                )
            )
        return out
