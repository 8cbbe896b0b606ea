"""How far one float32 computation of a model's log-probs is from the exact value, measured on this
machine's kernels: the scale of a tolerance between two float32 implementations of the same
log-probs (a sampler and a trainer), derived from the model itself instead of tuned on one CPU."""

from __future__ import annotations

import copy

import torch


def float32_logprob_error(model, tokenizer, prompts: list[str], *, max_tokens: int, temperature: float = 1.0,
                          n: int = 2, seed: int = 0) -> dict[str, float]:
    """``{"max", "mean"}``: the worst and the mean |float32 - float64| log-prob (of
    ``softmax(logits / temperature)``) over the tokens ``model`` samples for ``prompts``, ``n``
    each. Two float32 implementations of the same function each sit within about this of the exact
    value, so within about twice it of each other; other kernels (vLLM's, peft's) round
    differently but to the same precision."""
    from grpolab.core import build_sequences, get_response_log_probs
    from grpolab.core.logprobs import pad_token_id
    from grpolab.rollout import HFRolloutBackend, SamplingParams

    model = model.float().eval()
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    out = HFRolloutBackend(model, tokenizer).generate(prompts, n, params)
    seq = build_sequences([r.prompt_ids for r in out], [r.response_ids for r in out], pad_token_id(tokenizer))
    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        lp32 = get_response_log_probs(model, seq["input_ids"], seq["labels"], temperature=temperature)["log_probs"]
        lp64 = get_response_log_probs(exact, seq["input_ids"], seq["labels"], temperature=temperature)["log_probs"]
    error = (lp32.double() - lp64).abs()[seq["response_mask"]]
    return {"max": float(error.max()), "mean": float(error.mean())}
