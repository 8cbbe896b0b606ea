"""Reward lookup by name, custom ``package.module:function`` rewards, weighted sums, safe scoring."""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

from .tasks import arithmetic_reward_fn, countdown_reward_fn
from .verifiers import gsm8k_reward_fn, question_only_reward_fn, r1_zero_reward_fn

RewardFn = Callable[[str, Any], dict[str, float]]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "r1_zero": r1_zero_reward_fn,
    "r1_zero_lenient": partial(r1_zero_reward_fn, lenient_format=True),
    "question_only": question_only_reward_fn,
    "gsm8k": gsm8k_reward_fn,
    "arithmetic": arithmetic_reward_fn,
    "countdown": countdown_reward_fn,
}


def get_reward_fn(spec: str | RewardFn) -> RewardFn:
    """A reward function from a built-in name (``r1_zero``, ``question_only``, ``gsm8k``,
    ``arithmetic``, ``countdown``, ``r1_zero_lenient``) or a ``package.module:function`` path."""
    if callable(spec):
        return spec
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}: use one of {', '.join(BUILTIN_REWARDS)} or 'package.module:function'"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


@dataclass
class RewardComponent:
    """One term of a weighted reward: ``weight * fn(response, gt)[key]``."""

    fn: str | RewardFn
    weight: float = 1.0
    key: str = "reward"
    name: str | None = None


class WeightedReward:
    """``reward = sum_i weight_i * component_i``; every component is also reported as ``<name>``.

    ``format_reward``/``answer_reward`` are passed through from the first component that has them,
    so the health checks still see them. Example: 0.1 x format + 1.0 x answer of ``r1_zero``::

        WeightedReward([RewardComponent("r1_zero", 0.1, "format_reward"),
                        RewardComponent("r1_zero", 1.0, "answer_reward")])
    """

    def __init__(self, components: Sequence[RewardComponent | dict]):
        self.components = [c if isinstance(c, RewardComponent) else RewardComponent(**c) for c in components]
        if not self.components:
            raise ValueError("a weighted reward needs at least one component")
        self._fns = [get_reward_fn(c.fn) for c in self.components]
        self.names = []
        for i, c in enumerate(self.components):
            base = c.name or (c.fn if isinstance(c.fn, str) else getattr(c.fn, "__name__", f"fn{i}"))
            name = f"{base}.{c.key}" if c.name is None else base
            self.names.append(name if name not in self.names else f"{name}#{i}")

    def __call__(self, response: str, ground_truth: Any) -> dict[str, float]:
        cache: dict[int, dict] = {}
        out: dict[str, float] = {"reward": 0.0}
        for name, comp, fn in zip(self.names, self.components, self._fns):
            key = id(fn)
            if key not in cache:
                cache[key] = fn(response, ground_truth)
            scores = cache[key]
            value = float(scores[comp.key])
            out[name] = value
            out["reward"] += comp.weight * value
            for k in ("format_reward", "answer_reward"):
                if k in scores and k not in out:
                    out[k] = float(scores[k])
        return out


def build_reward(spec: Any) -> RewardFn:
    """A reward from config: a name/path string, or a list of component dicts (weighted sum)."""
    if isinstance(spec, (list, tuple)):
        return WeightedReward(spec)
    return get_reward_fn(spec)


def _checked(scores: Any) -> dict[str, float]:
    if not isinstance(scores, dict) or "reward" not in scores:
        raise TypeError(f"reward function returned {type(scores).__name__}, not a dict with 'reward'")
    out = {}
    for k, v in scores.items():
        v = float(v)  # raises for non-numbers
        if math.isnan(v) or math.isinf(v):
            raise ValueError(f"reward function returned {k}={v}")
        out[k] = v
    return out


def _call_checked(fn: RewardFn, response: str, ground_truth: Any) -> dict[str, float]:
    return _checked(fn(response, ground_truth))


def _call_chunk(fn: RewardFn, items: list[tuple[str, Any]]) -> list[dict[str, float] | str]:
    """Process-pool side: score a chunk; a failing item comes back as its error message."""
    out: list[dict[str, float] | str] = []
    for response, ground_truth in items:
        try:
            out.append(_call_checked(fn, response, ground_truth))
        except Exception as exc:  # noqa: BLE001
            out.append(f"{type(exc).__name__}: {exc}")
    return out


ZERO_SCORE = {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}


@dataclass
class RewardScorer:
    """Scores a batch safely: a reward that raises, returns NaN/inf or a non-number, or runs past
    ``timeout_s``, gives that sample the zero score and is counted in ``errors``; training goes on.

    ``num_workers > 0`` grades in a process pool (for heavy graders; the function must be
    importable, e.g. a built-in or ``package.module:function``). With ``num_workers=0`` a call
    that hangs is abandoned in its thread after ``timeout_s``.
    """

    reward_fn: RewardFn
    timeout_s: float = 10.0
    num_workers: int = 0
    errors: int = 0
    timeouts: int = 0
    last_error: str | None = None
    _pool: Any = field(default=None, repr=False)

    def _executor(self):
        if self._pool is None:
            if self.num_workers > 0:
                import multiprocessing as mp

                self._pool = cf.ProcessPoolExecutor(self.num_workers, mp_context=mp.get_context("spawn"))
            else:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="reward")
        return self._pool

    def _reset_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            if isinstance(pool, cf.ProcessPoolExecutor):
                for proc in list(getattr(pool, "_processes", {}).values()):
                    proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    def _failed(self, message: str) -> dict[str, float]:
        self.errors += 1
        self.last_error = message
        return dict(ZERO_SCORE)

    def score(self, responses: Sequence[str], ground_truths: Sequence[Any]) -> list[dict[str, float]]:
        if self.timeout_s is None or self.timeout_s <= 0:
            out = []
            for r, g in zip(responses, ground_truths):
                try:
                    out.append(_call_checked(self.reward_fn, r, g))
                except Exception as exc:  # noqa: BLE001 - any reward failure scores 0
                    out.append(self._failed(f"{type(exc).__name__}: {exc}"))
            return out
        if self.num_workers > 0:
            return self._score_pooled(list(zip(responses, ground_truths)))
        futures = [self._executor().submit(_call_checked, self.reward_fn, r, g) for r, g in zip(responses, ground_truths)]
        out = []
        for fut in futures:
            try:
                out.append(fut.result(timeout=self.timeout_s))
            except cf.TimeoutError:
                self.timeouts += 1
                out.append(self._failed(f"timed out after {self.timeout_s}s"))
                self._reset_pool()
                # the rest of the batch was cancelled with the pool: score them again
                rest = len(futures) - len(out)
                if rest:
                    out.extend(self.score(responses[len(out):], ground_truths[len(out):]))
                return out
            except Exception as exc:  # noqa: BLE001
                out.append(self._failed(f"{type(exc).__name__}: {exc}"))
        return out

    def _score_pooled(self, items: list[tuple[str, Any]], chunk: int = 64) -> list[dict[str, float]]:
        # chunks keep the inter-process traffic small; a chunk that times out is re-scored one by one
        chunks = [items[i : i + chunk] for i in range(0, len(items), chunk)]
        futures = [self._executor().submit(_call_chunk, self.reward_fn, c) for c in chunks]
        out: list[dict[str, float]] = []
        for i, (c, fut) in enumerate(zip(chunks, futures)):
            try:
                results = fut.result(timeout=self.timeout_s * len(c))
            except cf.TimeoutError:
                self._reset_pool()
                if len(c) == 1:
                    self.timeouts += 1
                    out.append(self._failed(f"timed out after {self.timeout_s}s"))
                else:
                    out.extend(self._score_pooled(c, chunk=1))
                rest = [item for later in chunks[i + 1 :] for item in later]
                return out + (self._score_pooled(rest, chunk) if rest else [])
            except Exception as exc:  # noqa: BLE001 - e.g. a worker died
                self._reset_pool()
                out.extend(self._failed(f"{type(exc).__name__}: {exc}") for _ in c)
                continue
            out.extend(r if isinstance(r, dict) else self._failed(r) for r in results)
        return out

    def close(self) -> None:
        self._reset_pool()
