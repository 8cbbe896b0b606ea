"""Reward lookup by name, custom ``package.module:function`` rewards, weighted sums, and the
reverse: the *spec* of a reward object, so that a worker process can rebuild it by importing it
instead of unpickling a closure (``reward_spec``), and whether it is a built-in that is safe to
run in the trainer's own process (``is_builtin_reward``)."""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from .reward_model import ModelReward, RewardModel, RewardModelOptions, is_model_component
from .tasks import arithmetic_reward_fn, countdown_reward_fn
from .verifiers import gsm8k_reward_fn, question_only_reward_fn, r1_zero_reward_fn
from .vf_reward import VfRubric

RewardFn = Callable[[str, Any], dict[str, float]]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "r1_zero": r1_zero_reward_fn,
    "r1_zero_lenient": partial(r1_zero_reward_fn, lenient_format=True),
    "question_only": question_only_reward_fn,
    "gsm8k": gsm8k_reward_fn,
    "arithmetic": arithmetic_reward_fn,
    "arithmetic_lenient": partial(arithmetic_reward_fn, lenient_format=True),
    "countdown": countdown_reward_fn,
    "countdown_lenient": partial(countdown_reward_fn, lenient_format=True),
}
# rewards that read an R1-format <answer> block (a chat model is asked for tags: prompt_template chat_r1)
TAGGED_REWARDS = ("r1_zero", "r1_zero_lenient", "arithmetic", "arithmetic_lenient", "countdown", "countdown_lenient")


def lenient_reward(reward: RewardFn) -> RewardFn:
    """The built-in ``reward``'s lenient-format form (any whitespace between ``</think>`` and
    ``<answer>``), or ``reward`` itself when it has none."""
    spec = reward_spec(reward)
    if isinstance(spec, str) and spec in BUILTIN_REWARDS and not spec.endswith("_lenient"):
        return BUILTIN_REWARDS.get(f"{spec}_lenient", reward)
    return getattr(reward, "lenient", reward)  # a module-level reward naming its lenient form (rewards.gym)


def reward_reads_tags(reward: Any) -> bool:
    """True for a reward that reads an ``<answer>`` block: the built-in R1 rewards, the embedded
    tasks' (a function with a ``lenient_format`` keyword), weighted sums of them."""
    if isinstance(reward, (list, tuple)):
        return any(reward_reads_tags(c["fn"] if isinstance(c, dict) else c.fn) for c in reward
                   if not is_model_component(c))
    if isinstance(reward, ModelReward):
        return reward.rule is not None and reward_reads_tags(reward.rule)
    if isinstance(reward, str):
        return reward in TAGGED_REWARDS
    spec = reward_spec(reward)
    if isinstance(spec, str) and spec in BUILTIN_REWARDS:
        return spec in TAGGED_REWARDS
    import inspect

    try:
        return "lenient_format" in inspect.signature(reward).parameters
    except (TypeError, ValueError):
        return False


def get_reward_fn(spec: str | RewardFn) -> RewardFn:
    """A reward function from a built-in name (``r1_zero``, ``question_only``, ``gsm8k``,
    ``arithmetic``, ``countdown``, ``r1_zero_lenient``) or a ``package.module:function`` path."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"reward: expected a reward name or 'package.module:function', got {_describe_value(spec)}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}: use one of {', '.join(BUILTIN_REWARDS)} or 'package.module:function'"
        )
    return import_callable(spec, "reward")


def import_callable(spec: str, what: str):
    """The callable named by ``"package.module:function"``; a one-line ``ValueError`` naming
    ``what`` (a reward, a custom tool) and the spec otherwise."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{what} {spec!r}: expected 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


CONTEXT_KEYWORDS = ("prompt", "question", "messages")  # what a reward may read besides (response, ground_truth)
CONTEXT_MARK = "__grpolab_context__"  # a response handed over as {mark, "response", <what the reward reads>}


def reward_reads(reward: Any) -> tuple[str, ...]:
    """The context a reward declares as parameters, of ``CONTEXT_KEYWORDS`` (``def fn(response,
    ground_truth, prompt)``: the prompt text the response continues; ``question``: the example's
    question, text or a conversation; ``messages``: a tool rollout's conversation, else the question's
    messages). A weighted sum reads what any of its components reads."""
    if isinstance(reward, WeightedReward):
        return tuple(k for k in CONTEXT_KEYWORDS if any(k in reward_reads(fn) for fn in reward._fns))
    import inspect

    try:
        params = inspect.signature(reward).parameters
    except (TypeError, ValueError):
        return ()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(k for k in CONTEXT_KEYWORDS if k in params and params[k].kind in keyword)


def with_context(response: str, prompt: Any = None, question: Any = None, messages: Any = None) -> dict:
    """A response with the context a ``reward_reads`` reward gets (plain data a worker can be sent)."""
    if messages is None and question is not None:
        messages = question if isinstance(question, list) else [{"role": "user", "content": str(question)}]
    return {CONTEXT_MARK: True, "response": response, "prompt": prompt, "question": question, "messages": messages}


def call_reward(fn: Callable, response: Any, ground_truth: Any) -> Any:
    """``fn(response, ground_truth)``, with the context ``fn`` declares when ``response`` carries it
    (``with_context``); a reward that declares none gets the text alone."""
    if isinstance(response, dict) and response.get(CONTEXT_MARK) and not isinstance(fn, WeightedReward):
        return fn(response["response"], ground_truth, **{k: response[k] for k in reward_reads(fn)})
    return fn(response, ground_truth)


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
                cache[key] = call_reward(fn, response, ground_truth)
            scores = cache[key]
            value = float(scores[comp.key])
            out[name] = value
            out["reward"] += comp.weight * value
            for k in ("format_reward", "answer_reward"):
                if k in scores and k not in out:
                    out[k] = float(scores[k])
        return out


class _ComponentSpec(BaseModel):
    """One weighted component of a config's ``reward:`` list."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)

    fn: Any
    weight: float = 1.0
    key: str = "reward"
    name: str | None = None

    @field_validator("fn")
    @classmethod
    def _fn(cls, value: Any) -> Any:
        if callable(value):
            return value
        return _check_reward_name(value)


def _check_reward_name(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a reward name or 'package.module:function', got {_describe_value(value)}")
    if value in BUILTIN_REWARDS:
        return value
    module, colon, fn = value.partition(":")
    if not colon:
        raise ValueError(f"unknown reward {value!r}: use one of {', '.join(BUILTIN_REWARDS)} "
                         "or 'package.module:function'")
    if not module.strip() or not fn.strip():
        raise ValueError(f"{value!r}: expected 'package.module:function' (both parts)")
    return value


def _describe_value(value: Any) -> str:
    if isinstance(value, dict):  # YAML reads `mod:` (unquoted) as a mapping
        return f"a mapping {value!r} (quote a 'package.module:function' value)"
    return f"{type(value).__name__} {value!r}"


def check_reward_spec(spec: Any) -> Any:
    """A config's ``reward:`` value, checked: None, a callable, a built-in name, a
    ``package.module:function`` path, or a non-empty list of component mappings (``fn``,
    ``weight``, ``key``, ``name``) and reward models (``{model: PATH, ...}``, alone or in the list).
    Else a one-line ValueError naming the key and the rule."""
    if spec is None or callable(spec):
        return spec
    if is_model_component(spec):
        return _check_model_component(spec, "reward")
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError("reward: a weighted reward needs at least one component")
        out = []
        for i, comp in enumerate(spec):
            if isinstance(comp, RewardComponent):
                comp = asdict(comp)
            if not isinstance(comp, dict):
                raise ValueError(f"reward[{i}]: expected a mapping with fn (and weight, key, name), "
                                 f"got {_describe_value(comp)}")
            if is_model_component(comp):
                out.append(_check_model_component(comp, f"reward[{i}]"))
                continue
            try:
                checked = _ComponentSpec.model_validate(comp)
            except ValidationError as exc:
                err = exc.errors()[0]
                loc = ".".join(str(p) for p in err["loc"])
                msg = "unknown key; expected fn, weight, key, name" if err["type"] == "extra_forbidden" else (
                    "required" if err["type"] == "missing" else err["msg"].removeprefix("Value error, "))
                raise ValueError(" ".join(f"reward[{i}].{loc}: {msg}".split())) from None
            out.append({k: getattr(checked, k) for k in comp})
        return out
    try:
        return _check_reward_name(spec)
    except ValueError as exc:
        raise ValueError(f"reward: {exc}") from None


def _check_model_component(spec: dict, where: str) -> dict:
    """A reward-model component's keys, checked (``RewardModelOptions``); one line naming the key."""
    try:
        return RewardModelOptions.model_validate(spec).model_dump(exclude_unset=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = ("unknown key; expected " + ", ".join(RewardModelOptions.model_fields)
               if err["type"] == "extra_forbidden"
               else err["msg"].removeprefix("Value error, "))
        raise ValueError(" ".join(f"{where}.{loc}: {msg}".split())) from None


def has_reward_model(reward: Any) -> bool:
    """True for a reward with a learned reward model (a built one, or its config spec)."""
    if isinstance(reward, ModelReward) or is_model_component(reward):
        return True
    return isinstance(reward, (list, tuple)) and any(is_model_component(c) for c in reward)


def build_reward(spec: Any) -> RewardFn:
    """A reward from config: a name/path string, a list of component dicts (weighted sum), or with
    reward models (``{model: PATH}``) a ``ModelReward`` (scored by ``RewardScorer`` with the prompts)."""
    if isinstance(spec, dict) and set(spec) == {"vf_rubric"}:  # VfRubric.worker_spec: the configured environment
        return VfRubric(**spec["vf_rubric"])
    if not callable(spec):
        spec = check_reward_spec(spec)
    if has_reward_model(spec):
        parts = spec if isinstance(spec, (list, tuple)) else [spec]
        rules = [c for c in parts if not is_model_component(c)]
        models = [RewardModel(RewardModelOptions(**c)) for c in parts if is_model_component(c)]
        return ModelReward(WeightedReward(rules) if rules else None, models)
    if isinstance(spec, (list, tuple)):
        return WeightedReward(spec)
    return get_reward_fn(spec)


def reward_spec(reward: Any) -> str | list[dict] | None:
    """What ``build_reward`` needs to rebuild ``reward`` in another process, or None when it cannot
    be named (a lambda, a closure, a callable object, a function of an unimportable ``__main__``).

    A built-in is named by its registry name; a module-level function by ``module:function``; a
    ``WeightedReward`` by its component dicts. The name is only returned when importing it gives
    back this very object, so the worker runs what the caller handed over.
    """
    if isinstance(reward, str):
        return reward
    own = getattr(reward, "worker_spec", None)  # a reward bound to configuration (VfRubric) names itself
    if isinstance(own, dict):
        return own
    if isinstance(reward, WeightedReward):
        parts = []
        for comp in reward.components:
            spec = reward_spec(comp.fn)
            if spec is None or not isinstance(spec, str):
                return None
            parts.append({**asdict(comp), "fn": spec})
        return parts
    for name, fn in BUILTIN_REWARDS.items():
        if reward is fn:
            return name
    module_name, qualname = getattr(reward, "__module__", None), getattr(reward, "__qualname__", "")
    if not module_name or not isinstance(qualname, str) or not qualname.isidentifier():
        return None  # "<lambda>", "f.<locals>.g", "Cls.method", a callable instance
    module = sys.modules.get(module_name)
    if module_name == "__main__":
        main_spec = getattr(module, "__spec__", None)
        if main_spec is None:  # a script run by path: a worker cannot import it
            return None
        module_name = main_spec.name  # "python -m pkg.train": importable as pkg.train
    if module is None or getattr(module, qualname, None) is not reward:
        return None
    return f"{module_name}:{qualname}"


def is_builtin_reward(reward: Any) -> bool:
    """True for the built-in verifiers (and weighted sums of them): pure functions over bounded
    inputs whose one slow step, math-verify, already runs in its own killable process. These are
    scored in the trainer's process; anything else goes to the supervised worker."""
    spec = reward_spec(reward)
    if isinstance(spec, str):
        return spec in BUILTIN_REWARDS
    if isinstance(spec, list):
        return all(part["fn"] in BUILTIN_REWARDS for part in spec)
    return False


def check_reward_output(scores: Any) -> dict[str, float]:
    """A reward's output as ``{key: float}``; raises for a non-dict, a missing ``reward``, a
    non-number, NaN or inf, so that the scorer counts it as an error instead of training on it."""
    if not isinstance(scores, dict) or "reward" not in scores:
        raise TypeError(f"reward function returned {type(scores).__name__}, not a dict with 'reward'")
    out = {}
    for k, v in scores.items():
        v = float(v)  # raises for non-numbers
        if math.isnan(v) or math.isinf(v):
            raise ValueError(f"reward function returned {k}={v}")
        if abs(v) > 3.4028234663852886e38:  # torch.finfo(torch.float32).max: rewards become float32 tensors
            raise ValueError(f"reward function returned {k}={v}, outside float32's range (rewards are float32)")
        out[str(k)] = v
    return out
