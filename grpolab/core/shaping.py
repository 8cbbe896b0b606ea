"""Reward shaping that depends only on the response: DAPO's soft overlong punishment.

DAPO's other overlong remedy, overlong *filtering* (truncated responses left out of the loss), is
only a mask: the trainer drops the rows whose finish reason is "length" from ``response_mask``.
"""

from __future__ import annotations

import torch


def overlong_reward_penalty(
    lengths: torch.Tensor,
    max_tokens: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), added to the task reward.

    With ``L_max = max_tokens`` and ``L_cache = buffer_len`` (the punishment interval):

    ``R(|y|) = 0``                                  if ``|y| <= L_max - L_cache``
    ``R(|y|) = ((L_max - L_cache) - |y|) / L_cache`` if ``L_max - L_cache < |y| <= L_max``
    ``R(|y|) = -1``                                 if ``|y| > L_max``

    i.e. no penalty up to ``L_max - L_cache``, then falling linearly to -1 at ``L_max``; the result
    is multiplied by ``penalty_factor`` (DAPO: 1.0, with L_max = 20480 and L_cache = 4096).
    ``lengths`` (N,) are response lengths in tokens; returns float32 (N,), all <= 0.
    """
    if not 0 < buffer_len <= max_tokens:
        raise ValueError(f"buffer_len must be in (0, max_tokens={max_tokens}], got {buffer_len}")
    lengths = lengths.to(torch.float64)
    start = float(max_tokens - buffer_len)
    penalty = ((start - lengths) / buffer_len).clamp(min=-1.0, max=0.0)
    return (penalty * penalty_factor).to(torch.float32)
