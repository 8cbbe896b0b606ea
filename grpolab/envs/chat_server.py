"""An OpenAI/vLLM-compatible endpoint over grpolab's sampler, for environments and agent harnesses
that want to call "a model" during a rollout, and for ``grpolab serve MODEL_DIR``:
``POST /v1/chat/completions`` (streamed or not), ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``POST /tokenize`` and ``/detokenize``, on 127.0.0.1 only.

A request's messages (and ``tools``) are rendered by the tokenizer's chat template (``hermes``:
``chat_tools.HERMES_TEMPLATE``) and sampled by the backend (the training model itself under
``hf``). Concurrent requests are batched: the first waits ``batch_wait_s`` for others, and each set
of equal sampling settings is one ``generate`` call (a seeded request is sampled alone, so the same
request with the same ``seed`` gives the same answer); when a batch fails, its requests are retried
one at a time, so a bad request fails alone. The answer is OpenAI's ``chat.completion`` object (or
its ``chat.completion.chunk`` server-sent events under ``stream: true``) plus vLLM's token fields
``prompt_token_ids`` and ``choices[i].token_ids``. Log-probs only when asked (``logprobs: true``,
``top_logprobs: N``), each entry's ``token`` its text (``"token_id:<id>"`` under vLLM's
``return_tokens_as_token_ids``); their values are the model's raw ``log_softmax(logits)`` as vLLM's
default ``logprobs_mode`` (``processed_logprobs``: the hf sampler's ``log_softmax(logits / T)`` at the
request's temperature, taken before top-p, where vLLM's are renormalised over the top-p set: equal
at ``top_p: 1``). A stop string ends the answer and is left out of ``content`` (the ids stay as sampled). With
``tools``, calls are parsed from the model's syntax (``chat_tools.parse_tool_calls``) into
``message.tool_calls``. A parameter the endpoint does not honour (``logit_bias``, a forced
``tool_choice``, ``response_format``, penalties, ...) is refused with a 400 naming it.

Bounds (``ChatServer`` arguments, ``grpolab serve`` options): a prompt must leave room for
``max_tokens`` in the model's context, checked before anything is sampled; ``max_tokens`` at most
``max_tokens`` (default: the context); ``n`` at most ``max_n`` (16); a body at most
``max_body_bytes`` (8 MiB), read within ``read_timeout_s`` (30 s); ``max_in_flight`` requests at once
(1024; the listen backlog is as large), more are answered 503; ``max_exchanges`` kept exchanges
(16,384; the oldest are dropped). A ``Host`` other than 127.0.0.1/localhost is refused (DNS
rebinding), and with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer KEY``.

Exact ids across turns. A request whose messages repeat a completion this server returned (the
same earlier messages, then that assistant message) continues from exactly the ids sampled then:
its prompt ids are that turn's prompt and completion ids, then the template's text for what
follows it, tokenised once (``ChatRenderer.after_turn``). So the ids of a whole conversation are
one sequence in which every model turn is the sampled ids. ``exchanges(key)`` returns what was
served under a request's ``model`` name (a driver gives each rollout its own, ``policy@<key>``);
``exchanges(key, pop=True)`` forgets them. A request's ``seed`` is offset by its turn (the number of
assistant messages it carries), so the turns of one conversation never replay one random stream
while a repeated request repeats.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..rollout import SamplingParams
from .chat_tools import _SENTINEL, CHAT_TEMPLATES, ChatRenderer, parse_tool_calls

SEED_STRIDE = 1_000_003  # turn t of a conversation samples with seed + t * SEED_STRIDE
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
class Exchange:
    """One served completion: the request's messages, the exact prompt and sampled ids, the sampler's
    log-probs, and whether the prompt continued an earlier completion's ids (``chained``) with the
    template re-rendering that turn exactly (``exact``)."""

    key: str
    messages: list[dict]
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    message: dict
    chained: bool = False
    exact: bool = True


@dataclass
class _Job:
    prompt_ids: list[int]
    sampling: SamplingParams
    n: int
    score: tuple | None = None  # (temperature or None for raw, top_n): log-probs by a forward of the model
    done: threading.Event = field(default_factory=threading.Event)
    outputs: list = field(default_factory=list)
    scores: list = field(default_factory=list)  # per output: (log-probs, top [(id, lp)] per token)
    error: str | None = None


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
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except (json.JSONDecodeError, RecursionError, ValueError):
                        pass
                fixed.append({**call, "function": {**fn, "arguments": args}})
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


def _norm(message: dict) -> str:
    """A message as compared across requests: role, text and calls (arguments parsed), nothing else."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError, ValueError):
                pass
        calls.append([fn.get("name"), args])
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


def _context_length(backend) -> int | None:
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


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024  # the multi-turn driver opens a whole rollout batch at once (C13: 5 lost 41 of 64)
    daemon_threads = True


class ChatServer:
    """``with ChatServer(backend, tokenizer) as server: server.url`` (``http://127.0.0.1:PORT/v1``); the
    bounds and the rest in the module docstring."""

    def __init__(self, backend, tokenizer, *, chat_template: str | None = None, port: int = 0,
                 batch_wait_s: float = 0.02, max_tokens: int | None = None, host: str = "127.0.0.1",
                 max_context: int | None = None, max_n: int = 16, max_body_bytes: int = 8 << 20,
                 max_exchanges: int = 16384, max_in_flight: int = 1024, read_timeout_s: float = 30.0,
                 api_key: str | None = None, logprobs_mode: str = "raw_logprobs", model_name: str = "policy"):
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"the chat endpoint listens on 127.0.0.1 only, not {host!r}: it runs the policy unguarded")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.backend, self.tokenizer = backend, tokenizer
        self.chat_template = CHAT_TEMPLATES.get(chat_template, chat_template) if chat_template else None
        self.context = max_context or _context_length(backend)
        self.batch_wait_s, self.max_tokens = batch_wait_s, max_tokens or self.context or 256
        self.max_n, self.max_body_bytes, self.max_exchanges = max_n, max_body_bytes, max_exchanges
        self.read_timeout_s, self.api_key, self.logprobs_mode = read_timeout_s, api_key, logprobs_mode
        self.model_name, self.created = model_name, int(time.time())
        self._jobs: queue.Queue = queue.Queue()
        self._served: OrderedDict[str, tuple[Exchange, dict]] = OrderedDict()  # digest -> (exchange, as rendered)
        self._by_key: dict[str, list[tuple[str, Exchange]]] = {}
        self._lock = threading.Lock()
        self._in_flight = threading.BoundedSemaphore(max_in_flight)
        self.max_in_flight = max_in_flight
        self._renderers: OrderedDict[str, ChatRenderer] = OrderedDict()
        self._render_lock = threading.Lock()
        self._http = _HTTPServer(("127.0.0.1", port), _handler(self))
        self._threads = [threading.Thread(target=self._http.serve_forever, daemon=True, name="grpolab-chat-http"),
                         threading.Thread(target=self._sample_loop, daemon=True, name="grpolab-chat-sampler")]
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    def __enter__(self) -> "ChatServer":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._http.shutdown()
            self._http.server_close()

    def exchanges(self, key: str, pop: bool = False) -> list[Exchange]:
        """What was served under the model name ``key``, in order (``pop``: and forget it, C15)."""
        with self._lock:
            if not pop:
                return [ex for _, ex in self._by_key.get(key, [])]
            held = self._by_key.pop(key, [])
            for digest, _ in held:
                self._served.pop(digest, None)
            return [ex for _, ex in held]

    def held(self) -> int:
        """How many exchanges the server holds."""
        with self._lock:
            return len(self._served)

    def _keep(self, digest: str, ex: Exchange, as_rendered: dict) -> None:
        with self._lock:
            old = self._served.pop(digest, None)
            if old is not None:  # the same answer to the same conversation: the latest wins
                self._forget(digest, old[0])
            self._served[digest] = (ex, as_rendered)
            self._by_key.setdefault(ex.key, []).append((digest, ex))
            while len(self._served) > self.max_exchanges:
                oldest, (gone, _) = self._served.popitem(last=False)
                self._forget(oldest, gone)

    def _forget(self, digest: str, ex: Exchange) -> None:
        held = self._by_key.get(ex.key, [])
        held[:] = [(d, e) for d, e in held if e is not ex]
        if not held:
            self._by_key.pop(ex.key, None)

    # ---------------------------------------------------------------- requests
    def _renderer(self, tools: list[dict] | None) -> ChatRenderer:
        key = json.dumps(tools or [], sort_keys=True)
        with self._render_lock:
            return self._renderer_locked(key, tools)

    def _renderer_locked(self, key: str, tools: list[dict] | None) -> ChatRenderer:
        if key not in self._renderers:
            renderer = ChatRenderer(self.tokenizer, list(tools or []), self.chat_template)
            if tools:
                renderer.check()
            else:
                probe = [{"role": "user", "content": "Q"}]
                turn = renderer.render(probe + [{"role": "assistant", "content": _SENTINEL}], with_tools=False)
                renderer._end_of_turn = turn[turn.index(_SENTINEL) + len(_SENTINEL):] if _SENTINEL in turn else ""
            self._renderers[key] = renderer
            while len(self._renderers) > 64:  # one per distinct tools list a client sends
                self._renderers.popitem(last=False)
        return self._renderers[key]

    def _prompt(self, messages: list[dict], renderer: ChatRenderer,
                digests: list[str]) -> tuple[list[int], bool, bool]:
        """(prompt ids, chained, exact): continuing the latest served turn these messages repeat, if any."""
        for k in range(len(messages) - 1, 0, -1):
            if messages[k].get("role") != "assistant":
                continue
            with self._lock:
                hit = self._served.get(digests[k + 1])
            if hit is None:
                continue
            served, as_rendered = hit
            history, following = messages[:k], messages[k + 1:]
            sampled = self.tokenizer.decode(served.completion_ids, skip_special_tokens=False)
            glue, exact = renderer.after_turn(history, as_rendered, following, sampled)
            ids = self.tokenizer(glue, add_special_tokens=False)["input_ids"]
            return served.prompt_ids + served.completion_ids + ids, True, exact
        text = renderer.render(messages, True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], False, True

    def _request(self, body: dict, prompt_len: int, default_max: int | None, allowed: set[str]) -> _Request:
        """The request's sampling settings (OpenAI/vLLM names), checked against the bounds; one 400 line."""
        _refuse_unhonoured(body, allowed)
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
            raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got "
                             f"{body.get('stop')!r}")
        for s in stop:
            _utf8(s, "stop")
        n = _int(body, "n", 1, self.max_n) or 1
        seed = _int(body, "seed", -(2 ** 63), 2 ** 63 - 1)
        min_tokens = _int(body, "min_tokens", 0) or 0
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        asked = _int(body, name, 1)
        room = None if self.context is None else self.context - prompt_len
        if room is not None and room < 1:
            raise BadRequest(f"the prompt has {prompt_len} tokens: it fills the model's context of {self.context} "
                             "tokens (shorten the conversation)")
        if asked is not None:
            if asked > self.max_tokens:
                raise BadRequest(f"{name} {asked} is over this server's limit of {self.max_tokens} tokens")
            if room is not None and asked > room:
                raise BadRequest(f"this model's context is {self.context} tokens: the prompt has {prompt_len}, "
                                 f"{name} {asked} would run past it (at most {room})")
        limit = asked or min(default_max or self.max_tokens, self.max_tokens, room or self.max_tokens)
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

    def complete(self, body: dict) -> dict:
        """The ``chat.completion`` answer to a request body (``BadRequest``: a bad request, one line)."""
        messages = _check_messages(body.get("messages"))
        tools = _check_tools(body.get("tools"))
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest(f"model must be a string, got {model!r}")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise BadRequest(f"unsupported parameter tool_choice {json.dumps(tool_choice)}: only auto and none (the "
                             "endpoint does not constrain decoding to force a call)")
        renderer = self._renderer(tools)
        digests = _prefix_digests(messages, len(renderer.schemas))
        prompt_ids, chained, exact = self._prompt(messages, renderer, digests)
        allowed = _SAMPLING | {"messages", "tools", "tool_choice"}
        req = self._request(body, len(prompt_ids), None, allowed)
        key = model or self.model_name
        if req.sampling.seed is not None:  # a harness sends one seed for every turn: each turn draws its own stream
            turn = sum(m.get("role") == "assistant" for m in messages)
            req.sampling.seed = (req.sampling.seed + SEED_STRIDE * turn) % 2 ** 63
        job = self._run(_Job(prompt_ids, req.sampling, req.n, self._score_of(req)))
        choices = []
        for i, out in enumerate(job.outputs):
            text = out.response if req.keep_stop else _cut_stop(out.response, req.sampling.stop)
            content, calls = parse_tool_calls(text, self.tokenizer, renderer.schemas) \
                if tools and tool_choice != "none" else (text, [])
            good = [c for c in calls if c.problem is None]
            message = {"role": "assistant", "content": (content or None) if good else text}
            if good:
                message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": {
                    "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in good]
            finish = "tool_calls" if good else ("length" if out.finish_reason == "length" else "stop")
            ex = Exchange(key, messages, list(prompt_ids), list(out.response_ids), list(out.logprobs), out.response,
                          finish, message, chained, exact)
            # the next turn re-renders this one from the text as sampled (a cut stop string put back)
            as_rendered = {**message, "content": (content if good else out.response) or ""}
            if good:
                as_rendered["tool_calls"] = [{**c, "function": {**c["function"], "arguments": g.arguments}}
                                             for c, g in zip(message["tool_calls"], good)]
            self._keep(hashlib.sha256((digests[-1] + _norm(message)).encode()).hexdigest(), ex, as_rendered)
            choice = {"index": i, "message": message, "finish_reason": finish, "token_ids": ex.completion_ids,
                      "logprobs": self._logprobs(req, job, i, out) if req.logprobs else None}
            choices.append(choice)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": key, "choices": choices, "prompt_token_ids": list(prompt_ids),
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}

    def text_complete(self, body: dict) -> dict:
        """The ``text_completion`` answer to a ``/v1/completions`` body: a prompt as text or token ids."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            _utf8(prompt, "prompt")
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and
                                                         0 <= t < len(self.tokenizer) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise BadRequest("prompt must be a non-empty string or a list of token ids (one prompt per request)")
        lp = body.get("logprobs")
        if lp is not None:
            lp = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        body = {k: v for k, v in body.items() if k not in ("logprobs", "prompt")}
        if lp is not None:
            body.update(logprobs=True, top_logprobs=lp)
        req = self._request(body, len(prompt_ids), 16, _SAMPLING)  # OpenAI's default max_tokens for completions
        job = self._run(_Job(prompt_ids, req.sampling, req.n, self._score_of(req)))
        choices = []
        for i, out in enumerate(job.outputs):
            text = out.response if req.keep_stop else _cut_stop(out.response, req.sampling.stop)
            logprobs = None
            if req.logprobs:
                entries = self._logprobs(req, job, i, out)["content"]
                logprobs = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                            "text_offset": _offsets(entries)}
            choices.append({"index": i, "text": text, "finish_reason": "length" if out.finish_reason == "length"
                            else "stop", "logprobs": logprobs, "token_ids": list(out.response_ids)})
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model") or self.model_name, "choices": choices, "prompt_token_ids": prompt_ids,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}

    def tokenize(self, body: dict) -> dict:
        """vLLM's ``/tokenize``: ``{"prompt": text}`` or ``{"messages": [...]}`` -> the ids the model would read."""
        if body.get("messages") is not None:
            messages = _check_messages(body["messages"])
            renderer = self._renderer(_check_tools(body.get("tools")))
            add = body.get("add_generation_prompt", True)
            ids = self.tokenizer(renderer.render(messages, bool(add)), add_special_tokens=False)["input_ids"]
        elif isinstance(body.get("prompt"), str):
            _utf8(body["prompt"], "prompt")
            ids = self.tokenizer(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))[
                "input_ids"]
        else:
            raise BadRequest("/tokenize needs prompt (a string) or messages")
        return {"count": len(ids), "max_model_len": self.context, "tokens": ids, "token_strs": None}

    def detokenize(self, body: dict) -> dict:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                   0 <= t < len(self.tokenizer) for t in tokens):
            raise BadRequest("tokens must be a list of token ids of this model")
        return {"prompt": self.tokenizer.decode(tokens)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "grpolab", "root": self.model_name, "parent": None,
                                            "max_model_len": self.context}]}

    # ---------------------------------------------------------------- log-probs
    def _score_of(self, req: _Request) -> tuple | None:
        """When the log-probs asked for are not the sampler's: (temperature or None for raw, top_n)."""
        if not req.logprobs:
            return None
        t, p = req.sampling.temperature, req.sampling.top_p
        if self.logprobs_mode == "raw_logprobs":
            same = (t == 1.0 or t == 0.0) and p == 1.0
            return None if same and not req.top_logprobs else (None, req.top_logprobs)
        return None if not req.top_logprobs else (t if t > 0 else None, req.top_logprobs)

    def _logprobs(self, req: _Request, job: _Job, i: int, out) -> dict:
        ids = list(out.response_ids)
        values, tops = job.scores[i] if job.score is not None else (list(out.logprobs), [[] for _ in ids])
        entries = []
        for t, lp, top in zip(ids, values, tops):
            entries.append({**self._token(t, req.as_ids), "logprob": lp,
                            "top_logprobs": [{**self._token(k, req.as_ids), "logprob": v} for k, v in top]})
        return {"content": entries}

    def _token(self, token_id: int, as_ids: bool) -> dict:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": f"token_id:{token_id}" if as_ids else text, "bytes": list(text.encode("utf-8", "replace"))}

    def _forward_scores(self, prompt_ids: list[int], ids: list[int], temperature, top_n: int):
        """(log-probs of ``ids``, the ``top_n`` most likely (id, log-prob) per position): one forward."""
        import torch

        model = getattr(self.backend, "model", None)
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

    # ---------------------------------------------------------------- sampling
    def _run(self, job: _Job) -> _Job:
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            if job.error.startswith("400 "):
                raise BadRequest(job.error[4:])
            raise RuntimeError(job.error)
        return job

    def _sample_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs, deadline = [job], time.monotonic() + self.batch_wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    more = self._jobs.get(timeout=left)
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)
                    break
                jobs.append(more)
            groups: dict[str, list[_Job]] = {}
            for j in jobs:  # a seeded request alone: its answer does not depend on what it was batched with
                groups.setdefault(repr((j.sampling, j.n)) if j.sampling.seed is None else str(id(j)), []).append(j)
            for group in groups.values():
                self._generate(group)

    def _generate(self, jobs: list[_Job]) -> None:
        n = jobs[0].n
        try:
            outs = self.backend.generate([""] * len(jobs), n, jobs[0].sampling, prompt_ids=[j.prompt_ids for j in jobs])
            for i, job in enumerate(jobs):
                job.outputs = outs[i * n:(i + 1) * n]
        except Exception as exc:  # noqa: BLE001 - the request gets the error, the server keeps serving
            if len(jobs) > 1:  # C14: one bad request must not fail the others batched with it
                for job in jobs:
                    self._generate([job])
                return
            jobs[0].error = f"sampling failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
        for job in jobs:
            if job.score is not None and job.error is None:
                try:
                    job.scores = [self._forward_scores(job.prompt_ids, list(o.response_ids), *job.score)
                                  for o in job.outputs]
                except BadRequest as exc:
                    job.error = f"400 {exc}"
                except Exception as exc:  # noqa: BLE001
                    job.error = f"scoring failed: {type(exc).__name__}: {exc}"
            job.done.set()


def _cut_stop(text: str, stops: list[str]) -> str:
    """The answer without the stop string that ended it (OpenAI and vLLM leave it out)."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[:min(cuts)] if cuts else text


def _offsets(entries: list[dict]) -> list[int]:
    out, at = [], 0
    for e in entries:
        out.append(at)
        at += len(e["token"])
    return out


def _chunks(answer: dict, include_usage: bool) -> list[dict]:
    """A ``chat.completion`` as the ``chat.completion.chunk`` events a streaming client reads: per choice the
    role, the content (with its log-probs), one delta per tool call, then ``finish_reason`` (and its
    ``token_ids``); the usage last when asked."""
    base = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"]}
    out = [{**base, "prompt_token_ids": answer["prompt_token_ids"],
            "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None} for c in answer["choices"]]}]
    for c in answer["choices"]:
        msg = c["message"]
        if msg.get("content") or c.get("logprobs"):
            out.append({**base, "choices": [{"index": c["index"], "delta": {"content": msg.get("content") or ""},
                                             "logprobs": c.get("logprobs"), "finish_reason": None}]})
        for k, call in enumerate(msg.get("tool_calls") or []):
            out.append({**base, "choices": [{"index": c["index"], "delta": {"tool_calls": [{"index": k, **call}]},
                                             "logprobs": None, "finish_reason": None}]})
        out.append({**base, "choices": [{"index": c["index"], "delta": {}, "logprobs": None,
                                         "finish_reason": c["finish_reason"], "token_ids": c["token_ids"]}]})
    if include_usage:
        out.append({**base, "choices": [], "usage": answer["usage"]})
    return out


def _text_chunks(answer: dict, include_usage: bool) -> list[dict]:
    base = {"id": answer["id"], "object": "text_completion", "created": answer["created"], "model": answer["model"]}
    out = [{**base, "choices": [{**c, "finish_reason": None, "token_ids": []}]} for c in answer["choices"]]
    out += [{**base, "choices": [{"index": c["index"], "text": "", "logprobs": None,
                                  "finish_reason": c["finish_reason"], "token_ids": c["token_ids"]}]}
            for c in answer["choices"]]
    if include_usage:
        out.append({**base, "choices": [], "usage": answer["usage"]})
    return out


def _handler(server: ChatServer):
    class Handler(BaseHTTPRequestHandler):
        timeout = server.read_timeout_s  # a client that never sends its body holds a thread this long at most

        def log_message(self, *args: Any) -> None:  # quiet: a rollout makes many requests
            pass

        def _send(self, code: int, obj: dict, headers: dict | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, kind: str = "invalid_request_error", headers=None) -> None:
            self._send(code, {"error": {"message": " ".join(message.split()), "type": kind, "param": None,
                                        "code": code}}, headers)

        def _refused(self, auth: bool = True) -> bool:
            """Host (DNS rebinding, C02) and the API key; True when the request was answered with a refusal."""
            host = (self.headers.get("Host") or "127.0.0.1").split(":")[0]
            if host not in ("127.0.0.1", "localhost"):
                self._error(403, f"Host {self.headers.get('Host')!r} refused: the endpoint answers 127.0.0.1 and "
                            "localhost only", "permission_error")
                return True
            if auth and server.api_key is not None and \
                    self.headers.get("Authorization") != f"Bearer {server.api_key}":
                self._error(401, "a valid API key is needed (Authorization: Bearer KEY)", "authentication_error")
                return True
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?")[0].rstrip("/")
            if self._refused(auth=path != "/health"):
                return
            if path == "/health":
                self._send(200, {})
            elif path == "/v1/models":
                self._send(200, server.models())
            else:
                self._error(404, f"no route {self.path}", "not_found")

        def _body(self) -> dict | None:
            if self.headers.get("Transfer-Encoding"):
                self._error(411, "the request body needs a Content-Length (a chunked body is not read)")
                return None
            try:
                size = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                size = -1
            if size < 0:
                self._error(400, f"bad Content-Length {self.headers.get('Content-Length')!r}")
                return None
            if size > server.max_body_bytes:
                self._error(413, f"the request body has {size} bytes, over this server's limit of "
                            f"{server.max_body_bytes}")
                return None
            raw = self.rfile.read(size)
            if len(raw) < size:
                self._error(400, f"the request body ended after {len(raw)} of {size} bytes")
                return None
            try:
                body = json.loads(raw or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                self._error(400, f"the request body is not JSON ({exc})")
                return None
            if not isinstance(body, dict):
                self._error(400, "the request body must be a JSON object")
                return None
            return body

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0].rstrip("/")
            routes = {"/v1/chat/completions": (server.complete, _chunks),
                      "/v1/completions": (server.text_complete, _text_chunks),
                      "/tokenize": (server.tokenize, None), "/detokenize": (server.detokenize, None)}
            if path not in routes:
                return self._error(404, f"no route {self.path}", "not_found")
            if self._refused():
                return
            if not server._in_flight.acquire(blocking=False):
                return self._error(503, f"the endpoint is busy: {server.max_in_flight} requests in flight",
                                   "server_error", {"Retry-After": "1"})
            try:
                try:
                    body = self._body()
                except (TimeoutError, OSError):
                    self.close_connection = True
                    return
                if body is None:
                    return
                answer_of, chunks_of = routes[path]
                try:
                    answer = answer_of(body)
                except ValueError as exc:  # BadRequest, and the renderer's one-line errors
                    return self._error(400, str(exc))
                except Exception as exc:  # noqa: BLE001 - one line to the client, the server stays up
                    return self._error(500, f"{type(exc).__name__}: {exc}", "server_error")
                if body.get("stream") and chunks_of is not None:
                    self._stream(chunks_of(answer, bool((body.get("stream_options") or {}).get("include_usage"))))
                else:
                    self._send(200, answer)
            finally:
                server._in_flight.release()

        def _stream(self, chunks: list[dict]) -> None:
            """Server-sent events: one ``data:`` line per chunk, then ``data: [DONE]``; the connection closes."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            for chunk in chunks:
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler
