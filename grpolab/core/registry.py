"""Name -> pure function registries for policy losses and advantage estimators.

A new loss is one function and one line: decorate it with ``@register_policy_loss("name")`` in
``core/losses.py`` (or anywhere that is imported) and ``loss_type="name"`` reaches it through
``compute_policy_gradient_loss``; config validators take the allowed values from
``policy_loss_names()``. Advantage estimators work the same way with
``@register_advantage_estimator`` and ``advantage_estimator_names()``.

The registries are plain dicts (``POLICY_LOSSES``, ``ADVANTAGE_ESTIMATORS``) in registration
order; use the helpers below rather than mutating them, so that names are checked. Full-vocabulary
divergences between a student's and a teacher's next-token distributions (``core/divergences.py``)
are registered the same way: ``@register_divergence`` and ``divergence_names()``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar

import torch


class PolicyLoss(Protocol):
    """The one signature every registered policy loss has (all inputs but the first by keyword).

    ``policy_log_probs`` (batch, seq) carries the gradient. ``raw_rewards`` / ``advantages`` are
    (batch,), (batch, 1) or per-token (batch, seq); ``old_log_probs`` (batch, seq) are the sampling
    policy's log-probs; ``cliprange`` / ``cliprange_high`` are PPO's epsilon (low and high). Any may
    be None; a loss that needs one raises ``ValueError("loss_type='name' requires <input>")``.
    ``**options`` are extras some losses need (``grpo_microbatch_train_step`` always passes
    ``response_mask`` (batch, seq) bool); a loss ignores the options it does not use.
    Returns ``(per_token_loss (batch, seq), metadata)``; metadata may hold ``"clipped"`` (bool,
    (batch, seq)), ``"dual_clipped"`` (bool) and ``"ratio"`` (detached, (batch, seq)), which the
    train step reports (``clip_fraction``, ``dual_clip_fraction``, ``ratio_mean``).
    """

    def __call__(
        self,
        policy_log_probs: torch.Tensor,
        *,
        raw_rewards: torch.Tensor | None,
        advantages: torch.Tensor | None,
        old_log_probs: torch.Tensor | None,
        cliprange: float | None,
        cliprange_high: float | None,
        **options: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class AdvantageEstimator(Protocol):
    """The one signature every registered advantage estimator has.

    ``raw_rewards`` (N,) are the rewards of N = n_prompts * group_size responses, grouped in
    consecutive blocks of ``group_size``. ``**options`` carry the estimator's knobs by keyword
    (``advantage_eps``, ``use_std_normalization``, ``scale_rewards`` for "grpo"; ``advantage_eps``,
    ``group_baseline`` for "reinforce_plus_plus"; a token-level estimator such as GAE would take
    ``values`` and ``response_mask`` (N, seq)); an estimator ignores options it does not use.
    Returns float32 advantages (N,) per response, or (N, seq) per token for token-level estimators
    (the policy losses broadcast both).
    """

    def __call__(self, raw_rewards: torch.Tensor, group_size: int, **options: Any) -> torch.Tensor: ...


class Divergence(Protocol):
    """The one signature every registered divergence has.

    ``student_logits`` and ``teacher_logits`` are (..., V) over the same vocabulary; both
    distributions are ``softmax(logits / temperature)``. ``beta`` is the mixture weight of the
    generalised Jensen-Shannon divergence (others ignore it). Returns the per-position divergence
    (...), in float32 at least (bf16/fp16 are upcast, float64 stays float64). The gradient flows
    into ``student_logits`` only (the teacher is detached inside); masking padded positions is the
    caller's (``torch.where`` on the mask, so that a non-finite padded value is never multiplied).
    """

    def __call__(
        self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature: float = 1.0,
        beta: float = 0.5,
    ) -> torch.Tensor: ...


POLICY_LOSSES: dict[str, PolicyLoss] = {}
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
DIVERGENCES: dict[str, Divergence] = {}

_F = TypeVar("_F", bound=Callable[..., Any])


def _register(table: dict, kind: str, name: str, replace: bool) -> Callable[[_F], _F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {kind} name must be a non-empty string, got {name!r}")
    if name in table and not replace:
        raise ValueError(f"{kind} {name!r} is already registered; pass replace=True to override it")

    def decorator(fn: _F) -> _F:
        if not callable(fn):
            raise TypeError(f"{kind} {name!r} must be callable, got {type(fn).__name__}")
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict, kind: str, name: str) -> Callable[..., Any]:
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {kind} {name!r}; expected one of {', '.join(table)}") from None


def _unregister(table: dict, kind: str, name: str) -> Callable[..., Any]:
    fn = _lookup(table, kind, name)
    del table[name]
    return fn


def register_policy_loss(name: str, *, replace: bool = False) -> Callable[[_F], _F]:
    """Decorator: register ``fn`` (with the ``PolicyLoss`` signature) as ``loss_type=name``."""
    return _register(POLICY_LOSSES, "loss_type", name, replace)


def unregister_policy_loss(name: str) -> PolicyLoss:
    """Remove ``name`` from the policy-loss registry and return its function."""
    return _unregister(POLICY_LOSSES, "loss_type", name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss ``name``; ValueError listing the registered names when unknown."""
    return _lookup(POLICY_LOSSES, "loss_type", name)


def policy_loss_names() -> tuple[str, ...]:
    """Registered ``loss_type`` values, in registration order (the CS336 four come first)."""
    return tuple(POLICY_LOSSES)


def register_advantage_estimator(name: str, *, replace: bool = False) -> Callable[[_F], _F]:
    """Decorator: register ``fn`` (with the ``AdvantageEstimator`` signature) under ``name``."""
    return _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name, replace)


def unregister_advantage_estimator(name: str) -> AdvantageEstimator:
    """Remove ``name`` from the advantage-estimator registry and return its function."""
    return _unregister(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The registered estimator ``name``; ValueError listing the registered names when unknown."""
    return _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def advantage_estimator_names() -> tuple[str, ...]:
    """Registered advantage-estimator names, in registration order."""
    return tuple(ADVANTAGE_ESTIMATORS)


def register_divergence(name: str, *, replace: bool = False) -> Callable[[_F], _F]:
    """Decorator: register ``fn`` (with the ``Divergence`` signature) under ``name``."""
    return _register(DIVERGENCES, "divergence", name, replace)


def unregister_divergence(name: str) -> Divergence:
    """Remove ``name`` from the divergence registry and return its function."""
    return _unregister(DIVERGENCES, "divergence", name)


def get_divergence(name: str) -> Divergence:
    """The registered divergence ``name``; ValueError listing the registered names when unknown."""
    return _lookup(DIVERGENCES, "divergence", name)


def divergence_names() -> tuple[str, ...]:
    """Registered divergence names, in registration order."""
    return tuple(DIVERGENCES)
