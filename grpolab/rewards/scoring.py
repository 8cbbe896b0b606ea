"""``RewardScorer``: the one way trainers and ``grpolab eval`` call a reward on a batch.

A reward is user code run on model output: it may raise, return NaN, never return, call
``os._exit`` or segfault. None of these may end or stall a training run; each is charged to its
sample (reward 0, counted in ``errors``, message in ``last_error``) and training goes on. Where the
reward runs (``isolation``):

- ``"auto"`` (default): the built-in verifiers (``r1_zero``, ``gsm8k``, ``countdown``, ...) run in
  this process — they are pure, bounded, and their slow step (math-verify) already has its own
  killable process; anything else runs in a supervised worker process (``supervisor.py``), rebuilt
  there from its spec (``registry.reward_spec``), never unpickled. A reward that has no spec (a
  lambda, a closure, a function of a script run by path) or that the worker cannot import runs
  in-process with a thread timeout, with a warning saying what is lost.
- ``"process"``: every reward, built-ins included, in workers (``num_workers`` of them, at least 1).
- ``"inprocess"``: in this process, with a per-call thread timeout: a hang is abandoned in its
  thread, and a crash ends the process.

``num_workers > 0`` also sends built-ins to that many workers, to grade in parallel.
``timeout_s`` is per response; ``0``/``None`` means no time limit (workers still catch crashes).

A reward with learned reward models (``reward_model.ModelReward``) has its rule part scored as
above and its models in this process, in batches, on ``device`` (``reward_model.py`` says why);
they read the prompts, so ``score`` then needs ``prompts``.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import warnings
from typing import Any, Sequence

from .isolation import child_sys_path
from .registry import (
    build_reward,
    call_reward,
    check_reward_output,
    is_builtin_reward,
    reward_reads,
    reward_spec,
    with_context,
)
from .reward_model import ModelReward
from .supervisor import DEFAULT_MEMORY_LIMIT_MB, UnsendableInputs, WorkerPool, WorkerStartError

ZERO_SCORE = {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
ISOLATION_MODES = ("auto", "process", "inprocess")


def _describe(reward: Any) -> str:
    return repr(reward_spec(reward) or getattr(reward, "__qualname__", None) or reward)


class RewardScorer:
    """Scores a batch safely (see the module docstring). Use as a context manager, or call
    ``close()``: it stops the thread pool and hands the workers back.

    ``errors``/``timeouts``/``worker_deaths`` count failed samples; ``last_error`` is the latest
    message ("timed out after 10.0s ...", "reward worker died (signal SIGSEGV (11)) ...",
    "RuntimeError: boom"); ``mode`` is where the reward runs now (``"builtin"``, ``"process"``,
    ``"thread"`` or ``"direct"``).
    """

    def __init__(self, reward_fn: Any, timeout_s: float | None = 10.0, num_workers: int = 0, *,
                 isolation: str = "auto", max_restarts: int = 8,
                 memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB, device=None):
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATION_MODES)}, not {isolation!r}")
        reward = build_reward(reward_fn) if isinstance(reward_fn, (str, list, tuple, dict)) else reward_fn
        self.model_reward = reward if isinstance(reward, ModelReward) else None
        self.reward_fn = reward.rule if self.model_reward is not None else reward
        self.device = device  # where reward models run unless they name a device
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.num_workers = num_workers
        self.isolation = isolation
        self.max_restarts = max_restarts
        self.memory_limit_mb = memory_limit_mb
        self.errors = self.timeouts = self.worker_deaths = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._threads: cf.ThreadPoolExecutor | None = None
        self._pool: WorkerPool | None = None
        self._spec = reward_spec(self.reward_fn)
        self.mode = self._choose_mode() if self.reward_fn is not None else "model"

    def _choose_mode(self) -> str:
        builtin = is_builtin_reward(self.reward_fn)
        if self.isolation == "inprocess" or (self.isolation == "auto" and builtin and self.num_workers == 0):
            if builtin and self.isolation == "auto":
                return "builtin"
            return "thread" if self.timeout_s else "direct"
        if self._spec is None:
            return self._fall_back("it cannot be named as 'module:function' or a built-in (a lambda, a closure, "
                                   "a callable object or a function of a script run by path)")
        return "process"

    def _fall_back(self, why: str) -> str:
        warnings.warn(
            f"reward {_describe(self.reward_fn)} runs in the trainer's process, not in a supervised worker: {why}. "
            "A call past the timeout is abandoned in its thread, and a crash (os._exit, segfault) ends the process. "
            "Define the reward at module level in an importable module to isolate it.",
            RuntimeWarning,
            stacklevel=4,  # the RewardScorer(...) or score(...) call
        )
        return "thread" if self.timeout_s else "direct"

    # ---------------------------------------------------------------- bookkeeping
    def _failed(self, message: str) -> dict[str, float]:
        self._count_error(message)
        return dict(ZERO_SCORE)

    def _count_error(self, message: str) -> None:
        self.errors += 1
        self.last_error = message
        if message.startswith("timed out"):
            self.timeouts += 1
        elif message.startswith("reward worker died"):
            self.worker_deaths += 1

    def _call(self, response: str, ground_truth: Any) -> dict[str, float]:
        try:
            return check_reward_output(call_reward(self.reward_fn, response, ground_truth))
        except Exception as exc:  # noqa: BLE001 - any reward failure scores 0
            return self._failed(f"{type(exc).__name__}: {exc}")

    # ---------------------------------------------------------------- scoring
    def score(self, responses: Sequence[str], ground_truths: Sequence[Any], prompts: Sequence[Any] | None = None,
              questions: Sequence[Any] | None = None, rollouts: Sequence[Any] | None = None) -> list[dict[str, float]]:
        """One score dict per response (``reward`` and whatever else the reward returns). Reward
        models read ``prompts`` (the text each response continues) or, with their ``chat_template``,
        ``questions``; rule rewards ignore both. A reward marked ``reads_rollout`` (a verifiers rubric)
        gets, for each of ``rollouts``, ``{"response", "messages", "info"}`` in place of the text."""
        if rollouts is not None and getattr(self.reward_fn, "reads_rollout", False):
            responses = [rollout_view(r) for r in rollouts]
            if getattr(self.reward_fn, "scores_groups", False):  # a rubric that scores a group together
                responses = group_views(responses, [getattr(r, "prompt_index", i) for i, r in enumerate(rollouts)])
        elif self.reward_fn is not None and reward_reads(self.reward_fn):  # it declared prompt/question/messages
            responses = [with_context(
                text, prompts[i] if prompts is not None else getattr(rollouts[i], "prompt", None) if rollouts else None,
                questions[i] if questions is not None else None,
                getattr(rollouts[i], "messages", None) if rollouts is not None else None)
                for i, text in enumerate(responses)]
        if self.model_reward is None:
            return self._score_rules(responses, ground_truths)
        if prompts is None:
            raise ValueError("a reward model scores the prompt with the response: RewardScorer.score(..., prompts=...)")
        rules = self._score_rules(responses, ground_truths) if self.reward_fn is not None else [{} for _ in responses]
        with self._lock:
            scores, errors = self.model_reward.combine(rules, list(prompts), list(responses), questions, self.device)
            for message in errors:
                self._count_error(message)
        return scores

    def state_dict(self) -> dict:
        """The reward models' running normalisation statistics (checkpointed by the trainers)."""
        return self.model_reward.state_dict() if self.model_reward is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.model_reward is not None:
            self.model_reward.load_state_dict(state)

    def _score_rules(self, responses: Sequence[str], ground_truths: Sequence[Any]) -> list[dict[str, float]]:
        items = list(zip(responses, ground_truths))
        with self._lock:
            if self.mode == "process":
                try:
                    return self._score_in_workers(items)
                except WorkerStartError as exc:
                    self.mode = self._fall_back(f"the worker could not load it ({exc})")
                except UnsendableInputs as exc:
                    warnings.warn(f"reward inputs cannot be sent to a worker ({exc}); scoring this batch in-process",
                                  RuntimeWarning, stacklevel=2)
                    return self._score_in_threads(items) if self.timeout_s else [self._call(*it) for it in items]
            if self.mode == "thread":
                return self._score_in_threads(items)
            return [self._call(r, g) for r, g in items]

    def _score_in_workers(self, items: list[tuple[str, Any]]) -> list[dict[str, float]]:
        if self._pool is None:
            self._pool = WorkerPool(self._spec, child_sys_path(cwd_last=True), self.num_workers,
                                    self.memory_limit_mb)
        results = self._pool.run(items, self.timeout_s, self.max_restarts)
        return [r if isinstance(r, dict) else self._failed(r) for r in results]

    def _score_in_threads(self, items: list[tuple[str, Any]]) -> list[dict[str, float]]:
        out: list[dict[str, float]] = []
        while len(out) < len(items):
            if self._threads is None:
                self._threads = cf.ThreadPoolExecutor(1, thread_name_prefix="reward")
            futures = [self._threads.submit(check_reward_output_of, self.reward_fn, r, g) for r, g in items[len(out):]]
            for fut in futures:
                try:
                    out.append(fut.result(timeout=self.timeout_s))
                except cf.TimeoutError:
                    message = f"timed out after {self.timeout_s}s (the call was abandoned in its thread)"
                    out.append(self._failed(message))
                    # the hung thread keeps the pool: start a new one and re-submit the rest
                    threads, self._threads = self._threads, None
                    threads.shutdown(wait=False, cancel_futures=True)
                    break
                except Exception as exc:  # noqa: BLE001
                    out.append(self._failed(f"{type(exc).__name__}: {exc}"))
        return out

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the thread pool and hand live workers back for reuse; the scorer may score again."""
        with self._lock:
            if self._threads is not None:
                self._threads.shutdown(wait=False, cancel_futures=True)
                self._threads = None
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._pool is not None:
                self._pool.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"RewardScorer({_describe(self.reward_fn)}, timeout_s={self.timeout_s}, mode={self.mode!r}, "
                f"errors={self.errors})")


def rollout_view(rollout) -> dict:
    """What a ``reads_rollout`` reward gets of a rollout: the model's text, its chat messages (None
    for a single-turn rollout) and its per-rollout figures, as plain data a worker can be sent."""
    return {"response": rollout.scored_response, "messages": rollout.messages, "info": dict(rollout.info)}


def group_views(views: list[dict], prompt_indices: Sequence[int]) -> list[dict]:
    """Each view with its whole group (``{"group": [views], "member": k}``): a group is the
    consecutive responses to one prompt (a GRPO group), which a group rubric scores together."""
    out, start = [], 0
    for end in range(1, len(views) + 1):
        if end == len(views) or prompt_indices[end] != prompt_indices[start]:
            group = views[start:end]
            out += [{"group": group, "member": k} for k in range(len(group))]
            start = end
    return out


def check_reward_output_of(reward_fn: Any, response: str, ground_truth: Any) -> dict[str, float]:
    """``reward_fn(response, ground_truth)``, checked (thread-pool side)."""
    return check_reward_output(call_reward(reward_fn, response, ground_truth))

