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
# Gradients go back through every layer, which amplifies that rounding: measured on SmolLM2's 30
# layers (AVX2), the head's and the last layers' gradients agree to ~1e-11 of their largest entry and
# layer 0's to 5.6e-8 of it. 1e-6 of each tensor's largest entry is that with ~20x room, while a wrong
# gradient of the head (the fused path's own backward) would be off by O(1) there and O(1e-2) below.
GRAD_REL_TOL = 1e-6


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
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[name] = (res["log_probs"].detach(), res["token_entropy"].detach(), grads)
    assert calls, "the fused head did not run: the comparison would be of one path with itself"
    assert chunk_tokens is None or labels.numel() > chunk_tokens, "one chunk only: pick a smaller chunk_tokens"
    return out


def assert_same(out: dict) -> None:
    for i, what in enumerate(("log-probs", "entropies")):
        fused, plain = out["fused"][i], out["plain"][i]
        diff = (fused - plain).abs().max().item()
        assert diff <= FLOAT64_TOL, f"{what}: fused and plain differ by {diff:.3g} (> {FLOAT64_TOL})"
        assert plain.abs().max().item() > 0, f"{what}: all zero, nothing compared"
    fused, plain = out["fused"][2], out["plain"][2]
    assert fused.keys() == plain.keys() and plain, "the two paths gave gradients to different parameters"
    for name, grad in plain.items():
        scale = grad.abs().max().item()
        diff = (fused[name] - grad).abs().max().item()
        assert diff <= GRAD_REL_TOL * scale + FLOAT64_TOL, \
            f"gradient of {name}: fused and plain differ by {diff:.3g} (> {GRAD_REL_TOL} x its largest, {scale:.3g})"
    assert any(grad.abs().max().item() > 0 for grad in plain.values()), "gradients: all zero, nothing compared"
