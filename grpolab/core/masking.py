"""Masked reductions (CS336 A5 §4.2) and whitening.

All masks are boolean (a float 0/1 mask is accepted too). Masked-out entries never contribute,
even when they hold NaN or inf.
"""

from __future__ import annotations

import torch


def as_column(x: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, 1) -> (B, 1), so per-sequence scalars broadcast over tokens."""
    return x.unsqueeze(-1) if x.dim() == 1 else x


def required(loss_type: str, name: str, value):
    """``value``, or a ``ValueError`` naming the loss that needs it when it is ``None``."""
    if value is None:
        raise ValueError(f"loss_type={loss_type!r} requires {name}")
    return value


def _masked_values(tensor: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (tensor with masked-out entries set to 0, mask as tensor's dtype)."""
    if mask.dtype == torch.bool:
        return torch.where(mask, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device)), mask.to(
            tensor.dtype
        )
    mask_f = mask.to(tensor.dtype)
    return tensor * mask_f, mask_f


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``tensor`` over the entries where ``mask`` is true (CS336 A5 ``masked_mean``).

    ``(tensor * mask).sum(dim) / mask.sum(dim)`` without keepdim. With ``dim=None`` it is the total
    masked sum over the total masked count (a token-level mean, not a mean of row means). A slice
    whose mask is all false gives NaN (0/0) on purpose: no clamp, no eps.
    """
    values, mask_f = _masked_values(tensor, mask)
    if dim is None:
        return values.sum() / mask_f.sum()
    return values.sum(dim) / mask_f.sum(dim)


def masked_normalize(
    tensor: torch.Tensor,
    mask: torch.Tensor,
    normalize_constant: float,
    dim: int | None = None,
) -> torch.Tensor:
    """Masked **sum** over ``dim`` (all elements when None) divided by ``normalize_constant``.

    CS336 A5 ``masked_normalize``; with a fixed constant this is Dr. GRPO's length normalisation
    (Liu et al. 2025). An all-false slice gives 0.
    """
    values, _ = _masked_values(tensor, mask)
    total = values.sum() if dim is None else values.sum(dim)
    return total / normalize_constant


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``values`` to mean 0 and standard deviation 1 over the masked entries.

    As ``masked_whiten`` in TRL / OpenRLHF (used for PPO advantages, Schulman et al. 2017): the
    variance uses Bessel's correction, matching ``torch.std``. With ``shift_mean=False`` the mean
    is added back (only the scale changes). Entries outside the mask are set to 0.
    """
    mask_b = mask.bool()
    mean = masked_mean(values, mask_b)
    count = mask_b.sum()
    centered, _ = _masked_values(values - mean, mask_b)
    var = (centered**2).sum() / (count - 1).clamp(min=1)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask_b, out, torch.zeros((), dtype=out.dtype, device=out.device))
