"""One comparison for the tiny and the real model: ``models.fused_head.response_log_probs`` (the
chunked, fused output head the trainers use) against ``core.get_response_log_probs`` (the plain
CS336 reference: the model's whole logits, then their log-softmax), in values and gradients."""

from __future__ import annotations

import copy

import torch

import grpolab.models.fused_head as fused_head
from grpolab.core import get_response_log_probs

# Both run in float64, where the two orders of summation differ by rounding of ~1e-16 relative;
# 1e-9 absolute leaves room for log-probs of magnitude ~10 summed over a vocabulary of ~50k.
FLOAT64_TOL = 1e-9


def fused_and_plain(model, ids: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_tokens: int | None,
                    monkeypatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Log-probs, entropies and every parameter's gradient (of ``sum(lp) + 0.3 * sum(H)``) by both
    paths, on a float64 copy of ``model``; checks that the fused path really ran chunk by chunk."""
    model = copy.deepcopy(model).double().eval()
    calls = []
    apply = fused_head._FusedHeadStats.apply
    monkeypatch.setattr(fused_head._FusedHeadStats, "apply", lambda *a: calls.append(a[5]) or apply(*a))
    out = {}
    for name, fn in (("fused", fused_head.response_log_probs), ("plain", get_response_log_probs)):
        model.zero_grad(set_to_none=True)
        res = fn(model, ids, labels, True, temperature=temperature, chunk_tokens=chunk_tokens)
        (res["log_probs"].sum() + 0.3 * res["token_entropy"].sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out[name] = (res["log_probs"].detach(), res["token_entropy"].detach(), grads)
    assert calls, "the fused head did not run: the comparison would be of one path with itself"
    assert chunk_tokens is None or labels.numel() > chunk_tokens, "one chunk only: pick a smaller chunk_tokens"
    return out


def assert_same(out: dict) -> None:
    for i, what in enumerate(("log-probs", "entropies", "gradients")):
        fused, plain = out["fused"][i], out["plain"][i]
        diff = (fused - plain).abs().max().item()
        assert diff <= FLOAT64_TOL, f"{what}: fused and plain differ by {diff:.3g} (> {FLOAT64_TOL})"
        assert plain.abs().max().item() > 0, f"{what}: all zero, nothing compared"
