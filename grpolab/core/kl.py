"""KL estimators (Schulman, "Approximating KL divergence", 2020) and KL coefficient controllers."""

from __future__ import annotations

import torch


def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref: unbiased estimate of KL(pi || pi_ref) from samples of pi, high variance."""
    return log_probs - ref_log_probs


def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log pi - log pi_ref)^2: biased, low variance, always >= 0."""
    return 0.5 * (log_probs - ref_log_probs) ** 2


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k3 = (rho - 1) - log rho with rho = pi_ref / pi: unbiased and >= 0 (the GRPO paper's KL term)."""
    log_rho = ref_log_probs - log_probs
    return torch.expm1(log_rho) - log_rho


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimator(name: str):
    """Look up ``kl_k1``/``kl_k2``/``kl_k3`` by name ("k1", "k2", "k3")."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r}; expected one of k1, k2, k3") from None


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
