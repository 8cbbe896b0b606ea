"""grpolab.core.masking: hand-computed cases, properties and gradchecks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.core import masked_mean, masked_normalize, whiten


def test_masked_mean_hand_cases():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert torch.allclose(masked_mean(x, m, dim=1), torch.tensor([1.5, 4.0]))
    assert torch.allclose(masked_mean(x, m, dim=0), torch.tensor([2.5, 2.0, float("nan")]), equal_nan=True)
    # dim=None is total sum over total count (7/3), not the mean of row means (2.75)
    assert masked_mean(x, m).item() == pytest.approx(7.0 / 3.0)
    assert masked_mean(x, m, dim=1).shape == (2,)


def test_masked_mean_empty_slice_is_nan_and_ignores_masked_garbage():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    m = torch.tensor([[True, False], [False, False]])
    out = masked_mean(x, m, dim=-1)
    assert out[0].item() == 1.0 and math.isnan(out[1].item())
    assert math.isnan(masked_mean(x, torch.zeros_like(m)).item())


def test_masked_mean_accepts_float_mask():
    x = torch.tensor([2.0, 4.0, 8.0])
    assert masked_mean(x, torch.tensor([1.0, 1.0, 0.0])).item() == 3.0


def test_masked_normalize_hand_cases():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[True, True, False], [False, False, False]])
    assert torch.allclose(masked_normalize(x, m, 2.0, dim=1), torch.tensor([1.5, 0.0]))
    assert torch.allclose(masked_normalize(x, m, 4.0, dim=0), torch.tensor([0.25, 0.5, 0.0]))
    assert masked_normalize(x, m, 3.0).item() == pytest.approx(1.0)


def test_whiten_hand_case_and_shift():
    v = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[True, True, True, False]])
    w = whiten(v, m)
    assert torch.allclose(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6)
    w2 = whiten(v, m, shift_mean=False)
    assert torch.allclose(w2, torch.tensor([[1.0, 2.0, 3.0, 0.0]]), atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000))
def test_masked_normalize_by_row_count_equals_masked_mean(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, dtype=torch.float64)
    m = torch.rand(b, t, generator=g) > 0.5
    m[:, 0] = True
    counts = m.sum(1)
    for i in range(b):
        got = masked_normalize(x[i], m[i], counts[i].item())
        assert torch.allclose(got, masked_mean(x[i], m[i]))


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 30), st.integers(0, 10_000))
def test_whitened_values_have_mean0_std1(n, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(1, n, generator=g, dtype=torch.float64) * 5 + 3
    m = torch.ones(1, n, dtype=torch.bool)
    m[0, -1] = n == 2  # keep at least two masked entries
    w = whiten(v, m)[m]
    assert abs(w.mean().item()) < 1e-6
    assert abs(w.std().item() - 1.0) < 1e-4


def test_masking_gradchecks():
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    m = torch.rand(3, 4) > 0.3
    m[:, 0] = True
    assert torch.autograd.gradcheck(lambda t: masked_mean(t, m, dim=1), (x,))
    assert torch.autograd.gradcheck(lambda t: masked_normalize(t, m, 3.0, dim=0), (x,))
    assert torch.autograd.gradcheck(lambda t: whiten(t, m), (x,))
