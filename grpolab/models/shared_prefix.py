"""Response log-probs with the prompt computed once per group (training, with gradients).

In GRPO every prompt has ``group_size`` responses. The usual training forward runs each
prompt+response sequence separately, so a prompt's tokens go through the model ``group_size``
times. Here each distinct prompt goes through once; its KV cache is then indexed out to its
responses (a differentiable gather), and the responses are run on top of it. The log-probs and the
gradient are the same (up to float summation order) with far fewer tokens computed when prompts
are long next to responses. Works for Hugging Face causal LMs whose forward accepts a KV cache.
"""

from __future__ import annotations

import inspect

import torch

from ..core import log_probs_from_logits
from .fused_head import log_probs_from_forward


def _cache_kw(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def supports_shared_prefix(model) -> bool:
    cfg = getattr(model, "config", None)
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers 4.x name
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing or getattr(model, "grpolab_compiled", False):  # models.compiled: its block takes no KV cache
        return False
    return cfg is not None and not getattr(cfg, "is_encoder_decoder", False) and hasattr(model, "forward")


def shared_prefix_response_log_probs(
    model,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    prompt_of_row: list[int],
    pad_id: int,
    device,
    return_token_entropy: bool = False,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> dict[str, torch.Tensor]:
    """Log-probs (of softmax(logits / ``temperature``)) of each row's response tokens, in *response
    layout*: (R, Tr) with column ``j`` the ``j``-th response token. ``prompt_ids`` holds the
    distinct prompts; ``prompt_of_row[r]`` says which one row ``r`` continues. Returns
    ``log_probs``, ``response_mask`` (bool) and, when asked, ``token_entropy``. Logits are computed
    ``chunk_tokens`` positions at a time (see ``fused_head.response_log_probs``), for a chunkable
    head at the response tokens only; past a row's end both figures are 0 (padding)."""
    n_rows = len(response_ids)
    if n_rows == 0:
        raise ValueError("no rows")
    # 1. the distinct prompts, left-padded, once
    p_len = [len(p) for p in prompt_ids]
    width = max(p_len)
    p_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    p_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        p_ids[i, width - len(p) :] = torch.tensor(p)
        p_mask[i, width - len(p) :] = 1
    p_ids, p_mask = p_ids.to(device), p_mask.to(device)
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    kw = _cache_kw(model)
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True, logits_to_keep=1)
    cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
    index = torch.tensor(prompt_of_row, dtype=torch.long, device=device)
    first_logits = out.logits[:, -1:].index_select(0, index)  # predicts each response's first token

    # 2. the responses on top of their prompt's cache
    r_len = [len(r) for r in response_ids]
    t_resp = max(r_len)
    labels = torch.full((n_rows, t_resp), pad_id, dtype=torch.long)
    resp_mask = torch.zeros((n_rows, t_resp), dtype=torch.bool)
    for i, r in enumerate(response_ids):
        labels[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        resp_mask[i, : len(r)] = True
    labels, resp_mask = labels.to(device), resp_mask.to(device)
    # the first response token's log-prob comes from the prompt pass: (rows, 1, vocab) logits at most
    log_probs, entropy = log_probs_from_logits(first_logits, labels[:, :1], return_token_entropy,
                                               temperature=temperature, chunk_tokens=chunk_tokens)
    if t_resp > 1:
        cache.batch_select_indices(index)
        inputs = labels[:, :-1]
        attn = torch.cat([p_mask.index_select(0, index), resp_mask[:, :-1].long()], dim=1)
        starts = torch.tensor(p_len, device=device).index_select(0, index)[:, None]
        pos = starts + torch.arange(t_resp - 1, device=device)
        # the rest without their (rows, t_resp - 1, vocab) logits: chunked over positions (core.logprobs)
        rest = log_probs_from_forward(
            model, labels[:, 1:],
            lambda **extra: model(input_ids=inputs, attention_mask=attn, position_ids=pos, use_cache=True,
                                  **{kw: cache}, **extra),
            return_token_entropy, temperature=temperature, chunk_tokens=chunk_tokens, positions=resp_mask[:, 1:])
        log_probs = torch.cat([log_probs, rest["log_probs"]], dim=1)
        if return_token_entropy:
            entropy = torch.cat([entropy, rest["token_entropy"]], dim=1)
    result = {"log_probs": log_probs, "response_mask": resp_mask}
    if return_token_entropy:
        result["token_entropy"] = entropy
    return result


def label_to_response_layout(
    tensor: torch.Tensor, prompt_lengths: list[int], response_lengths: list[int]
) -> torch.Tensor:
    """Re-index (R, T) label-layout values (``build_sequences``) into (R, Tr) response layout."""
    t_resp = max(response_lengths)
    starts = torch.tensor([p - 1 for p in prompt_lengths])[:, None]
    idx = (starts + torch.arange(t_resp)[None, :]).clamp(max=tensor.shape[1] - 1)
    out = tensor.gather(1, idx.to(tensor.device))
    valid = torch.arange(t_resp)[None, :] < torch.tensor(response_lengths)[:, None]
    return torch.where(valid.to(tensor.device), out, torch.zeros((), dtype=tensor.dtype, device=tensor.device))


def response_to_label_layout(values: torch.Tensor, prompt_lengths: list[int], response_lengths: list[int],
                             width: int) -> torch.Tensor:
    """The inverse of ``label_to_response_layout``: (R, Tr) response layout -> (R, width) label
    layout, zeros elsewhere."""
    out = torch.zeros(values.shape[0], width, dtype=values.dtype)
    for j, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        out[j, p - 1 : p - 1 + r] = values[j, :r].detach().cpu()
    return out


def prompt_key(sequence: tuple[list[int], list[int], int]) -> tuple:
    """What makes a rollout batch row's prompt one the shared-prompt forward runs once: its prompt
    index *and* its ids (rows of one group may open differently: C5-3)."""
    return sequence[2], tuple(sequence[0])


def shared_prefix_rows(model, sequences: list[tuple[list[int], list[int], int]], rows: list[int], pad_id: int,
                       device, *, temperature: float = 1.0, return_token_entropy: bool = False,
                       chunk_tokens: int | None = None) -> dict:
    """``shared_prefix_response_log_probs`` for ``rows`` of a rollout batch whose ``sequences[r]``
    is (prompt ids, response ids, prompt index): each distinct prompt (``prompt_key``: its index and
    its ids; a verifiers env whose ``setup_state`` varies the opening gives one group several) is
    run once. Adds the rows' ``prompt_lengths`` and ``response_lengths`` for re-laying per-token tensors."""
    distinct: dict[tuple, int] = {}
    prompts, prompt_of_row = [], []
    for r in rows:
        p_ids, key = sequences[r][0], prompt_key(sequences[r])
        if key not in distinct:
            distinct[key] = len(prompts)
            prompts.append(p_ids)
        prompt_of_row.append(distinct[key])
    out = shared_prefix_response_log_probs(model, prompts, [sequences[r][1] for r in rows], prompt_of_row, pad_id,
                                           device, return_token_entropy, temperature=temperature,
                                           chunk_tokens=chunk_tokens)
    out["prompt_lengths"] = [len(sequences[r][0]) for r in rows]
    out["response_lengths"] = [len(sequences[r][1]) for r in rows]
    return out
