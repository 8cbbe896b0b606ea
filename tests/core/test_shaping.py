"""grpolab.core.shaping: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13)."""

import pytest
import torch

from grpolab.core import overlong_reward_penalty


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    # L_max = 20, L_cache = 5: 0 up to 15, then (15 - |y|) / 5, -1 from 20 on
    got = overlong_reward_penalty(lengths, max_tokens=20, buffer_len=5, penalty_factor=1.0)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    half = overlong_reward_penalty(lengths.float(), 20, 5, 0.5)
    assert half.tolist() == pytest.approx([0.0, 0.0, -0.1, -0.3, -0.5, -0.5])
    assert overlong_reward_penalty(torch.tensor([0, 19, 20]), 20, 20, 2.0).tolist() == pytest.approx([0.0, -1.9, -2.0])


@pytest.mark.parametrize("buffer_len", [0, -1, 21])
def test_overlong_penalty_rejects_a_bad_buffer(buffer_len):
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_reward_penalty(torch.tensor([1]), 20, buffer_len, 1.0)
