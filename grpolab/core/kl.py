"""KL estimators (Schulman, "Approximating KL divergence", 2020) and KL coefficient controllers.

Each estimator maps per-token log-probs (batch, seq) of the policy pi and of the reference to a
(batch, seq) estimate, with ``r = pi_ref(x) / pi(x)`` and ``x ~ pi`` (on-policy samples). Its
*value* and, when it is added to the loss (GRPO eq. 3, ``loss += kl_coef * k``), its *gradient*
estimate different things. For a loss term only ``log pi(x)`` is differentiated, never the
sampling of ``x``, so ``E_pi[grad k(x)]`` is what the optimiser follows:

- k1 = log(pi/ref): value unbiased for KL(pi||ref); as a loss its expected gradient is
  ``E_pi[grad log pi] = 0``, so it regularises nothing. Use it as a reward penalty instead
  (``reward - kl_coef * k1``, Ziegler et al. 2019), where it enters through the score function.
- k2 = 0.5 * log(pi/ref)^2: value biased (>= 0, low variance); as a loss its expected gradient is
  ``E_pi[log(pi/ref) grad log pi] = grad KL(pi||ref)``: the reverse KL that RLHF regularises.
- k3 = (r - 1) - log r: value unbiased for KL(pi||ref) (>= 0, low variance); as a loss its
  expected gradient is ``E_pi[(1 - r) grad log pi] = -sum_x ref(x) grad log pi(x) =
  grad KL(ref||pi)``: the *forward* (mass-covering) KL, not the reverse KL its value estimates
  (the two gradients agree only to first order near pi = ref).

For sequences these hold per position given the prefix: the part of the sequence-level KL
gradient that flows through which prefixes are visited is missing from every loss-term estimator
(Tang & Munos 2025; Shah et al. 2025, "A Comedy of Estimators: On KL Regularization in RL Training
of LLMs", arXiv:2512.21852). ``tests/core/test_kl.py`` checks the three identities exactly on a
categorical distribution.
"""

from __future__ import annotations

import torch


def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref, (batch, seq): unbiased for KL(pi||ref), high variance, can be < 0.

    As a loss term: zero expected gradient (E_pi[grad log pi] = 0); use it as a reward penalty.
    """
    return log_probs - ref_log_probs


def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log pi - log pi_ref)^2, (batch, seq): biased, low variance, always >= 0.

    As a loss term: its expected gradient is grad KL(pi||ref), the reverse KL.
    """
    return 0.5 * (log_probs - ref_log_probs) ** 2


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k3 = (rho - 1) - log rho, rho = pi_ref / pi, (batch, seq): unbiased for KL(pi||ref), >= 0
    (the GRPO paper's KL term, Shao et al. 2024 eq. 4).

    As a loss term: its expected gradient is grad KL(ref||pi), the forward KL.
    """
    log_rho = ref_log_probs - log_probs
    return torch.expm1(log_rho) - log_rho


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}

# Estimators whose gradient regularises when added to the loss (k2: reverse KL, k3: forward KL).
KL_LOSS_ESTIMATORS = ("k2", "k3")


def kl_estimator(name: str):
    """Look up ``kl_k1``/``kl_k2``/``kl_k3`` by name ("k1", "k2", "k3")."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r}; expected one of {', '.join(KL_ESTIMATORS)}") from None


def check_kl_loss_estimator(name: str) -> None:
    """Raise ValueError unless ``name`` is a KL estimator that may be added to the loss.

    ``k1`` may not: its expected gradient as a loss term is 0 (module docstring).
    """
    kl_estimator(name)
    if name not in KL_LOSS_ESTIMATORS:
        raise ValueError(
            f"kl_estimator {name!r} has zero expected gradient as a loss term (E_pi[grad log pi] = 0), "
            f"so it regularises nothing; use {' or '.join(KL_LOSS_ESTIMATORS)}, or apply {name} as a reward penalty"
        )


class FixedKLController:
    """A constant KL coefficient with the adaptive controller's interface."""

    def __init__(self, coef: float = 0.2):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences", §2.2).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``coef *= 1 + e * n_steps / horizon``; the value is
    then kept within ``[min_coef, max_coef]`` (the seed design: 0.2 within [0.1, 0.3]).
    """

    def __init__(
        self,
        init_coef: float = 0.2,
        target: float = 6.0,
        horizon: int = 10000,
        min_coef: float = 0.1,
        max_coef: float = 0.3,
    ):
        if not min_coef <= max_coef:
            raise ValueError(f"min_coef ({min_coef}) must not exceed max_coef ({max_coef})")
        if horizon <= 0 or target <= 0:
            raise ValueError("target and horizon must be positive")
        self.target = float(target)
        self.horizon = float(horizon)
        self.min_coef = float(min_coef)
        self.max_coef = float(max_coef)
        self.value = min(max(float(init_coef), self.min_coef), self.max_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        self.value = min(max(self.value, self.min_coef), self.max_coef)
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
