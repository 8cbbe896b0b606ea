"""Stop strings matched on decoded text, however the model spells them.

A model can write ``</answer>`` as one special token, as nine characters, or with a token that
straddles its end (``r>x``); only the decoded text tells. Decoding every row's response at every
step would cost a tokenizer call per row per token, so the check has two stages:

1. a per-vocabulary mask (computed once per tokenizer and set of stop strings) of the tokens whose
   text can end a stop string: those containing a stop string's last character, plus those that
   decode to a partial character (byte-level pieces). A row whose new token is not in the mask
   cannot have just completed a stop string; for most steps no row is, and nothing is decoded;
2. for the rows whose new token is in the mask, the last ``window`` tokens are decoded with and
   without the new token (one batched tokenizer call), and a stop string counts when an occurrence
   ends inside the new token's characters. ``window`` is the longest stop string's length in UTF-8
   bytes + 2: every token carries at least one byte, and the extra tokens keep decoders that strip a
   leading space (SentencePiece) from touching the stop string.

Occurrences completed before ``min_tokens`` are ignored and never trigger later (vLLM's semantics:
stop strings are checked from ``min_tokens`` on).
"""

from __future__ import annotations

from typing import Sequence

import torch

_PARTIAL = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


def stop_end(text: str, stops: Sequence[str], after: int = 0) -> int:
    """End offset (exclusive) of the earliest-ending occurrence of any stop string in ``text`` that
    ends after character ``after``; -1 when there is none."""
    best = -1
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))
        if i >= 0 and (best < 0 or i + len(s) < best):
            best = i + len(s)
    return best


def decode_batch(tokenizer, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
    """Raw decoded text (no clean-up of spaces) of many id lists in one call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: one Rust call
        return backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
    return tokenizer.batch_decode(
        sequences, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def token_texts(tokenizer) -> list[str]:
    """Each id's text as it appears after another token (so a decoder's first-token rules, such as
    SentencePiece's leading-space strip, do not apply); ``None`` where that cannot be told."""
    anchor = tokenizer("a", add_special_tokens=False)["input_ids"][-1:]
    n = len(tokenizer)
    texts = decode_batch(tokenizer, [anchor + [i] for i in range(n)])
    head = decode_batch(tokenizer, [anchor])[0]
    return [t[len(head) :] if t.startswith(head) else None for t in texts]


class StopStringDetector:
    """Which rows have just completed a stop string (see the module docstring)."""

    def __init__(self, tokenizer, stops: Sequence[str], texts: list[str | None] | None = None):
        if not stops or any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 2
        texts = token_texts(tokenizer) if texts is None else texts
        last = {s[-1] for s in self.stops}
        self._candidates = torch.tensor(
            [t is None or _PARTIAL in t or any(c in t for c in last) for t in texts], dtype=torch.bool
        )
        self._by_device: dict[tuple[int, str], torch.Tensor] = {}

    def candidates(self, vocab_size: int, device) -> torch.Tensor:
        """(vocab_size,) bool: ids whose text can end a stop string (ids past the tokenizer: yes)."""
        key = (vocab_size, str(device))
        if key not in self._by_device:
            mask = torch.ones(vocab_size, dtype=torch.bool)
            k = min(vocab_size, len(self._candidates))
            mask[:k] = self._candidates[:k]
            self._by_device[key] = mask.to(device)
        return self._by_device[key]

    def completes(self, windows: list[list[int]]) -> list[bool]:
        """For each window (the last tokens of a row, the newest last): does the newest token end an
        occurrence of a stop string? One tokenizer call for all windows."""
        if not windows:
            return []
        texts = decode_batch(self.tokenizer, [w[:-1] for w in windows] + list(windows))
        prev, cur = texts[: len(windows)], texts[len(windows) :]
        return [stop_end(c, self.stops, len(p.rstrip(_PARTIAL))) >= 0 for p, c in zip(prev, cur)]

    def cut(self, response_ids: list[int], text: str) -> str:
        """``text`` (``tokenizer.decode(response_ids, skip_special_tokens=True)`` of a row that
        stopped) cut right after the stop string its last token completed: a token that straddles
        the stop string's end leaves its extra characters out of the text (its id stays in the
        response ids). Unchanged when the stop string is not in ``text`` (a special token that
        ``skip_special_tokens`` removed)."""
        prev = self.tokenizer.decode(response_ids[:-1], skip_special_tokens=True)
        end = stop_end(text, self.stops, len(prev.rstrip(_PARTIAL)))
        return text[:end] if end >= 0 else text
