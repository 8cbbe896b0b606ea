"""Rollouts from a Hugging Face causal LM with a hand-rolled sampling loop over the KV cache.

Why not ``model.generate``: we need the sampler's per-token log-probs, stop strings kept in the
output, ``min_tokens``, and exact finish reasons, with little per-step overhead. The loop:

1. left-pad the prompts and prefill each prompt once (only the last position's logits are
   computed), then repeat its KV cache ``n`` times — the group shares one prefill. For
   Llama/Qwen2-architecture models a lean forward (``fast_decoder``) replaces the Hugging Face
   forward, whose per-call overhead dominates small models; other models use the latter;
2. sample token by token (temperature, top-p; greedy at temperature 0) with an explicit
   ``torch.Generator`` so runs are reproducible and resumable, recording each sampled token's
   log-prob under the tempered distribution ``log_softmax(logits / T)`` before top-p (the policy
   the trainer scores; at ``T == 0`` the untempered ``log_softmax(logits)``);
3. end a row on any of the model's end ids (the tokenizer's eos and every id in
   ``generation_config.eos_token_id``) or on a stop string found in the decoded text
   (``stops.StopStringDetector``), and drop it from the KV cache at once, so long tails do not pay
   for finished sequences.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Sequence

import torch

from ..core import pad_token_id
from . import fast_decoder
from .base import Rollout, SamplingParams, model_end_ids, prompt_token_ids
from .stops import StopStringDetector, token_texts


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
    """Nucleus sampling (Holtzman et al. 2020) as Hugging Face's ``TopPLogitsWarper`` and vLLM do:
    keep the smallest set of most likely tokens whose mass reaches ``top_p``, i.e. drop a token when
    the mass of the tokens no more likely than it, itself included, is ``<= 1 - top_p``; the most
    likely token is always kept. ``probs`` (..., V) -> the kept probabilities (not renormalised)."""
    sorted_probs, order = probs.sort(dim=-1)  # ascending, as the reference implementations
    drop = sorted_probs.cumsum(-1) <= 1 - top_p
    drop[..., -1] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


# torch.multinomial's CPU kernel costs ~1.2 us per vocabulary entry and row (77 ms for 64 rows of a
# 49k vocabulary, a fifth of a SmolLM2 decode step); from this vocabulary size on, a token is drawn by
# inverse transform sampling instead: one float64 cumulative sum and a binary search per row (5 ms).
# Both draw exactly from the given probabilities; smaller vocabularies keep torch.multinomial (and
# the draws, for a seed, that they always had).
INVERSE_CDF_MIN_VOCAB = 4096


def _draw(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token per row of (unnormalised, non-negative) ``probs`` (rows, V), drawn with ``generator``."""
    if probs.shape[-1] < INVERSE_CDF_MIN_VOCAB:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    cdf = probs.double().cumsum_(-1)
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # as torch.multinomial refuses them
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0, or sums to 0")
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64) * cdf[:, -1:]
    # the first entry whose cumulative mass exceeds u: never a zero-probability token
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    over = tokens >= probs.shape[-1]  # u rounded up to the total (vanishingly rare): the last token with mass
    if bool(over.any()):
        tokens[over] = (probs[over] > 0).cumsum(-1).argmax(-1)
    return tokens


def _sample(logits: torch.Tensor, sampling: SamplingParams, blocked: torch.Tensor | None, generator):
    """One token per row and its log-prob under ``log_softmax(logits / T)`` (``T == 0``: T = 1),
    taken before top-p and before ``blocked`` ids (eos and stops under ``min_tokens``) are masked."""
    temp = sampling.temperature
    scaled = logits / temp if temp not in (0.0, 1.0) else logits
    logp = torch.log_softmax(scaled, dim=-1)
    scores = scaled if blocked is None else scaled.index_fill(-1, blocked, float("-inf"))
    if temp == 0:
        next_tok = scores.argmax(-1)
    else:
        probs = torch.softmax(scores, dim=-1)
        if sampling.top_p < 1.0:
            probs = _top_p_filter(probs, sampling.top_p)
        next_tok = _draw(probs.cpu(), generator).to(logits.device)
    return next_tok, logp.gather(-1, next_tok.unsqueeze(-1)).squeeze(-1)


class HFRolloutBackend:
    """``generate(prompts, n, sampling)`` on the training model itself (no weight copy to sync).

    ``Rollout.response_ids`` are the exact sampled ids, the end token or the stop string's last
    token included. ``Rollout.response`` is their text without special tokens; when the token that
    completes a stop string carries characters past it (``r>x`` completing ``</answer>``), the text
    is cut right after the stop string while ``response_ids`` keep that whole token (training scores
    the sampled ids), so there ``response`` is shorter than ``decode(response_ids)``.
    """

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
        self._token_texts: list[str | None] | None = None
        self._detectors: dict[tuple[str, ...], StopStringDetector] = {}
        self._stop_ids: dict[tuple[str, ...], list[int]] = {}
        self.fast_path = fast_path
        self._fast = None

    def sync_weights(self, model) -> None:
        self.model = model

    def close(self) -> None:
        """Nothing to free: the backend holds no weights of its own."""

    # ---------------------------------------------------------------- helpers
    def end_ids(self) -> list[int]:
        """The ids that end a response: the tokenizer's eos and ``generation_config.eos_token_id``
        (an int or a list: chat models list several, e.g. ``<|im_end|>`` and ``<|endoftext|>``)."""
        return model_end_ids(self.model, self.tokenizer)

    def _detector(self, stops: Sequence[str]) -> StopStringDetector | None:
        key = tuple(stops)
        if not key:
            return None
        if key not in self._detectors:
            if self._token_texts is None:  # one decode of the vocabulary per backend
                self._token_texts = token_texts(self.tokenizer)
            self._detectors[key] = StopStringDetector(self.tokenizer, key, self._token_texts)
        return self._detectors[key]

    def _stop_token_ids(self, stops: Sequence[str]) -> list[int]:
        """Stop strings that are one token: ``min_tokens`` masks those ids, as it masks eos."""
        key = tuple(stops)
        if key not in self._stop_ids:
            encoded = [self.tokenizer(s, add_special_tokens=False)["input_ids"] for s in stops]
            self._stop_ids[key] = [e[0] for e in encoded if len(e) == 1]
        return self._stop_ids[key]

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
    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams,
                 prompt_ids: Sequence[list[int]] | None = None) -> list[Rollout]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        prompt_ids = prompt_token_ids(self.tokenizer, prompts, prompt_ids)
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
                    if n <= self.max_batch_size:
                        rollouts.extend(self._generate_chunk(prompts, prompt_ids, chunk, n, sampling, generator))
                        continue
                    # a group larger than the batch bound: sample it in parts of at most max_batch_size rows
                    for done in range(0, n, self.max_batch_size):
                        part = min(self.max_batch_size, n - done)
                        rollouts.extend(self._generate_chunk(prompts, prompt_ids, chunk, part, sampling, generator))
        finally:
            self.model.train(was_training)
            if self._fast is not None:
                self._fast.release()
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
        engine = self._engine()
        logits = engine.prefill(ids.to(device), mask.to(device), sampling.max_tokens)
        if n > 1:
            engine.repeat(n)
            logits = logits.repeat_interleave(n, 0)
        tokens, logprobs, out_len, reason = self._decode(engine, logits, len(chunk) * n, sampling, generator)
        detector = self._detector(sampling.stop)
        out = []
        for row in range(len(chunk) * n):
            n_tok = int(out_len[row])
            resp_ids = tokens[row, :n_tok].tolist()
            text = self.tokenizer.decode(resp_ids, skip_special_tokens=True)
            if reason[row] == "stop":
                text = detector.cut(resp_ids, text)
            p = chunk[row // n]
            out.append(Rollout(prompt=prompts[p], response=text, prompt_ids=list(prompt_ids[p]), response_ids=resp_ids,
                               logprobs=logprobs[row, :n_tok].tolist(), finish_reason=reason[row], prompt_index=p))
        return out

    def _decode(self, engine, logits, batch, sampling, generator):
        """The sampling loop -> sampled ids (batch, max_tokens), their log-probs, lengths, reasons."""
        device = logits.device
        max_tokens = sampling.max_tokens
        tokens = torch.full((batch, max_tokens), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros((batch, max_tokens), dtype=torch.float32)
        out_len = torch.zeros(batch, dtype=torch.long)
        reason = ["length"] * batch
        active = torch.arange(batch)  # rows of the current cache -> original rows
        end_ids = self.end_ids()
        end_t = torch.tensor(end_ids, dtype=torch.long)
        detector = self._detector(sampling.stop)
        blocked = end_ids + self._stop_token_ids(sampling.stop)
        blocked_t = torch.tensor(blocked, device=device) if blocked else None
        for t in range(max_tokens):
            next_tok, tok_lp = _sample(logits, sampling, blocked_t if t < sampling.min_tokens else None, generator)
            next_cpu = next_tok.cpu()
            tokens[active, t] = next_cpu
            logprobs[active, t] = tok_lp.float().cpu()
            out_len[active] = t + 1
            if t < sampling.min_tokens:  # no end before min_tokens tokens (vLLM: stop strings must end after them)
                if t + 1 < max_tokens:
                    logits = engine.step(next_tok)
                continue
            done = self._finished(next_cpu, t, active, tokens, reason, end_t, detector, logits.shape[-1])
            if t + 1 == max_tokens or bool(done.all()):
                break
            if bool(done.any()):
                # finished rows leave the cache at once: later steps only pay for live rows (measured on
                # SmolLM2: dropping them in batches of a quarter of the rows saved nothing)
                keep = (~done).nonzero().flatten()
                engine.select(keep.to(device))
                next_tok, active = next_tok[keep.to(device)], active[keep]
            logits = engine.step(next_tok)
        return tokens, logprobs, out_len, reason

    @staticmethod
    def _finished(next_tok, t, active, tokens, reason, end_t, detector, vocab_size) -> torch.Tensor:
        """(live rows,) bool on CPU: the rows that end at step ``t`` (``next_tok`` on CPU); sets
        their finish reasons. An end id wins over a stop string ending on the same token."""
        done = torch.isin(next_tok, end_t)
        for r in done.nonzero().flatten().tolist():
            reason[int(active[r])] = "eos"
        if detector is not None:
            check = (detector.candidates(vocab_size, "cpu")[next_tok] & ~done).nonzero().flatten().tolist()
            if check:
                lo = max(0, t + 1 - detector.window)
                rows = [int(active[r]) for r in check]
                hits = detector.completes([tokens[row, lo : t + 1].tolist() for row in rows])
                for r, row, hit in zip(check, rows, hits):
                    if hit:
                        reason[row] = "stop"
                        done[r] = True
        return done
