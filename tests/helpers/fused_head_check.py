"""One comparison for the tiny and the real model: ``models.fused_head.response_log_probs`` (the
chunked, fused output head the trainers use) against ``core.get_response_log_probs`` (the plain
CS336 reference: the model's whole logits, then their log-softmax).

What the fused path replaces is the output head, so that is where the two are compared: the
log-probs and entropies, the gradient they send into the model (at the head's input, the last
hidden state) and the head weight's gradient (the float64 copy gets a head of its own, equal to the
embeddings it may be tied to, so that gradient is the head's alone).
Both run in float64 and differ only in the order of their sums, so each must agree within the
classic forward-error bound of a sum: ``n * u`` of its largest value, with ``u = 2**-53`` and ``n``
the terms one output sums (the hidden size for a logit, the vocabulary for its log-sum-exp) — a
bound from the arithmetic, not from this CPU. Below the head the backward is the model's own
autograd on both paths; there the two only differ by that rounding amplified through the layers
(by up to ~1e9 on SmolLM2, whose gradients are that ill-conditioned), so they are checked for
reaching the same parameters, not for equal bits. A head gradient off by 1e-6 of itself is caught."""

from __future__ import annotations

import copy

import torch

import grpolab.models.fused_head as fused_head
from grpolab.core import get_response_log_probs

UNIT_ROUNDOFF = 2.0**-53


def _run(fn, model, ids, labels, temperature, chunk_tokens) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    res = fn(model, ids, labels, True, temperature=temperature, chunk_tokens=chunk_tokens, return_last_hidden=True)
    hidden = res["last_hidden_state"]
    hidden.retain_grad()
    (res["log_probs"].sum() + 0.3 * res["token_entropy"].sum()).backward()
    out = {"log-probs": res["log_probs"].detach(), "entropies": res["token_entropy"].detach(),
           "gradient into the model (at the head's input)": hidden.grad.clone()}
    out["head weight's gradient"] = model.get_output_embeddings().weight.grad.clone()
    out["parameters reached"] = sorted(n for n, p in model.named_parameters() if p.grad is not None and p.grad.any())
    return out


def fused_and_plain(model, ids: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_tokens: int | None,
                    monkeypatch) -> dict[str, dict]:
    """The head's outputs and gradients (of ``sum(lp) + 0.3 * sum(H)``) by both paths on a float64 copy
    of ``model``; checks that the fused path really ran, chunk by chunk."""
    model = copy.deepcopy(model).double().eval()
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untied: same values, its own gradient
    model.config.tie_word_embeddings = False
    calls = []
    apply = fused_head._FusedHeadStats.apply
    monkeypatch.setattr(fused_head._FusedHeadStats, "apply", lambda *a: calls.append(a[5]) or apply(*a))
    out = {"fused": _run(fused_head.response_log_probs, model, ids, labels, temperature, chunk_tokens),
           "plain": _run(get_response_log_probs, model, ids, labels, temperature, chunk_tokens),
           "terms": model.config.hidden_size + model.config.vocab_size}
    assert calls, "the fused head did not run: the comparison would be of one path with itself"
    assert chunk_tokens is None or labels.numel() > chunk_tokens, "one chunk only: pick a smaller chunk_tokens"
    return out


def assert_same(out: dict) -> None:
    """Every output of the head within ``n * u`` of its largest value (module doc); the same
    parameters reached below it."""
    fused, plain = out["fused"], out["plain"]
    assert fused.keys() == plain.keys()
    assert fused.pop("parameters reached") == plain.pop("parameters reached"), "the paths reach other parameters"
    for name, value in plain.items():
        scale = value.abs().max().item()
        assert scale > 0, f"{name}: all zero, nothing compared"
        diff, bound = (fused[name] - value).abs().max().item(), out["terms"] * UNIT_ROUNDOFF * scale
        assert diff <= bound, f"{name}: fused and plain differ by {diff:.3g} > n * u * {scale:.3g} = {bound:.3g}"
