"""What a request to the chat endpoint (``chat_server``) asks, checked: its messages (content as text,
OpenAI text parts joined), tools and sampling settings against the server's bounds, every parameter it
would otherwise drop refused by name; each problem a ``BadRequest`` (a 400) of one line naming the field.
And the log-probs a request asks for that are not the sampler's (``forward_log_probs``)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from ..rollout import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16  # stop strings per request
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# what a request may carry that the endpoint does not use, at these values only (vLLM/OpenAI defaults)
_NEUTRAL = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "top_k": (-1, 0),
    "repetition_penalty": (1, 1.0), "response_format": ({"type": "text"},), "parallel_tool_calls": (True,),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "skip_special_tokens": (True,),
    "best_of": (1,), "echo": (False,), "store": (False,), "logprobs_mode": (), "suffix": ("",),
}
_METADATA = {"model", "user", "metadata", "return_token_ids", "service_tier"}
_SAMPLING = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "stop", "seed", "stream",
             "stream_options", "logprobs", "top_logprobs", "min_tokens", "return_tokens_as_token_ids",
             "include_stop_str_in_output"}




class BadRequest(ValueError):
    """A request the endpoint refuses (400): one line naming the field."""


@dataclass
class _Request:
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    as_ids: bool
    keep_stop: bool
    max_tokens_given: bool


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or OpenAI text parts (joined by newlines, as vLLM's
    ``string`` content format)."""
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}[{j}]: only text parts ({{type: text, text: ...}}) are served, not {kind!r}")
            parts.append(part["text"])
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise BadRequest(f"{where} must be a string or a list of text parts, not {type(content).__name__}")
    _utf8(content, where)
    return content


def _utf8(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{where} is not valid Unicode text (a lone surrogate)") from None


def _check_messages(messages: Any) -> list[dict]:
    """The request's messages, checked and with content as text; tool-call arguments as objects."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if m.get("content") is None and role != "assistant":
            raise BadRequest(f"messages[{i}].content is missing ({role} messages need text)")
        msg = {**m, "content": _text_of(m.get("content"), f"messages[{i}].content")}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"messages[{i}].tool_calls must be a list, on an assistant message")
            fixed = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                        not isinstance(fn.get("arguments", {}), (str, dict)):
                    raise BadRequest(f"messages[{i}].tool_calls[{j}] must be {{type: function, function: "
                                     "{name, arguments}}")
                fixed.append({**call, "function": {**fn, "arguments": _arguments(fn)}})
            msg["tool_calls"] = fixed
        out.append(msg)
    return out


def _check_tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of {type: function, function: {name, ...}} objects")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise BadRequest(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}")
    return tools


def _arguments(fn: dict) -> Any:
    """A call's arguments parsed when they are JSON text, else as given (a client may send either)."""
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args)
        except (json.JSONDecodeError, RecursionError, ValueError):
            pass
    return args


def _norm(message: dict) -> str:
    """A message as compared across requests: role, text and calls (arguments parsed), nothing else."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        calls.append([fn.get("name"), _arguments(fn)])
    return json.dumps([message.get("role"), message.get("content") or "", calls], sort_keys=True)


def _prefix_digests(messages: list[dict], n_tools: int) -> list[str]:
    """``d[k]``: a digest of ``messages[:k]`` (and the number of tools), each from the one before: linear
    in the conversation's length (C12: a key per assistant message was a JSON dump of its history)."""
    digests = [hashlib.sha256(str(n_tools).encode()).hexdigest()]
    for m in messages:
        digests.append(hashlib.sha256((digests[-1] + _norm(m)).encode()).hexdigest())
    return digests


def _int(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        raise BadRequest(f"{name} must be within [{low}, {high}], got {value}" if high is not None else
                         f"{name} must be >= {low}, got {value}")
    return value


def _float(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _refuse_unhonoured(body: dict, allowed: set[str]) -> None:
    """One 400 naming every parameter the endpoint would otherwise drop."""
    bad = []
    for name, value in body.items():
        if name in allowed or name in _METADATA or value is None:
            continue
        if name in _NEUTRAL and value in _NEUTRAL[name]:
            continue
        bad.append(name)
    if bad:
        raise BadRequest(f"unsupported parameter{'s' * (len(bad) > 1)} {', '.join(sorted(bad))}: grpolab's endpoint "
                         "does not honour them (it samples with temperature, top_p, max_tokens, min_tokens, n, stop, "
                         "seed; tool_choice auto or none)")


def context_length(backend) -> int | None:
    """The model's context (positions), from the backend: vLLM's ``max_model_len`` or the HF config."""
    value = getattr(backend, "max_model_len", None)
    if isinstance(value, int) and value > 0:
        return value
    config = getattr(getattr(backend, "model", None), "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def parse_request(body: dict, *, prompt_len: int, context: int | None, cap: int, max_n: int,
                  default_max: int | None, allowed: set[str]) -> _Request:
    """The request's sampling settings (OpenAI/vLLM names), checked against the bounds; one 400 line."""
    _refuse_unhonoured(body, allowed)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got "
                         f"{body.get('stop')!r}")
    for s in stop:
        _utf8(s, "stop")
    n = _int(body, "n", 1, max_n) or 1
    seed = _int(body, "seed", -(2 ** 63), 2 ** 63 - 1)
    min_tokens = _int(body, "min_tokens", 0) or 0
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = _int(body, name, 1)
    room = None if context is None else context - prompt_len
    if room is not None and room < 1:
        raise BadRequest(f"the prompt has {prompt_len} tokens: it fills the model's context of {context} "
                         "tokens (shorten the conversation)")
    if asked is not None:
        if asked > cap:
            raise BadRequest(f"{name} {asked} is over this server's limit of {cap} tokens")
        if room is not None and asked > room:
            raise BadRequest(f"this model's context is {context} tokens: the prompt has {prompt_len}, "
                             f"{name} {asked} would run past it (at most {room})")
    limit = asked or min(default_max or cap, cap, room or cap)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage", "continuous_usage_stats"} \
            or stream_options.get("continuous_usage_stats"):
        raise BadRequest(f"stream_options may hold include_usage only, got {stream_options!r}")
    logprobs, top = body.get("logprobs"), _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest(f"logprobs must be true or false, got {logprobs!r}")
    if top and not logprobs:
        raise BadRequest("top_logprobs needs logprobs: true")
    for flag in ("stream", "return_tokens_as_token_ids", "include_stop_str_in_output"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise BadRequest(f"{flag} must be true or false, got {body[flag]!r}")
    if seed is not None:
        seed %= 2 ** 63
    try:
        sampling = SamplingParams(temperature=_float(body, "temperature", 1.0), top_p=_float(body, "top_p", 1.0),
                                  max_tokens=limit, min_tokens=min(min_tokens, limit), stop=list(stop), seed=seed)
    except ValueError as exc:
        raise BadRequest(f"bad sampling settings: {exc}") from None
    return _Request(sampling, n, bool(body.get("stream")), bool(stream_options.get("include_usage")),
                    bool(logprobs), top, bool(body.get("return_tokens_as_token_ids")),
                    bool(body.get("include_stop_str_in_output")), asked is not None)


def _stop_hit(text: str, stops: list[str]) -> str | None:
    """The stop string that ended ``text`` (the earliest in it; on a tie the first asked), else None."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits, key=lambda hit: hit[0])[1] if hits else None


def stop_reason(out, stops: list[str]) -> str | None:
    """vLLM's ``stop_reason`` of a sampled output: the stop string that ended it, None at the end of text or
    at ``max_tokens``."""
    return None if out.finish_reason == "length" else _stop_hit(out.response, stops)


def _cut_stop(text: str, stops: list[str]) -> str:
    """The answer without the stop string that ended it (OpenAI and vLLM leave it out)."""
    hit = _stop_hit(text, stops)
    return text[:text.find(hit)] if hit is not None else text


def _offsets(entries: list[dict]) -> list[int]:
    out, at = [], 0
    for e in entries:
        out.append(at)
        at += len(e["token"])
    return out



def forward_log_probs(model, prompt_ids: list[int], ids: list[int], temperature, top_n: int):
    """(log-probs of ``ids``, the ``top_n`` most likely (id, log-prob) per position): one forward."""
    import torch

    if model is None:
        raise BadRequest("these log-probs (raw at a temperature other than 1, or top_logprobs) need the model "
                         "in this process (the hf backend)")
    device = next(model.parameters()).device
    seq = torch.tensor([prompt_ids + ids], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(seq[:, :-1]).logits[0, len(prompt_ids) - 1:].float()
    finally:
        model.train(was_training)
    if temperature is not None:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, torch.tensor(ids, device=device)[:, None])[:, 0].tolist()
    tops = [[] for _ in ids]
    if top_n:
        v, k = lp.topk(top_n, dim=-1)
        tops = [list(zip(row_k, row_v)) for row_k, row_v in zip(k.tolist(), v.tolist())]
    return chosen, tops
