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
rebinding), and with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer KEY``. The
request checks are in ``chat_requests``, the routes and streaming in ``chat_http``.

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
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from ..rollout import SamplingParams
from .chat_http import _HTTPServer, handler_for
from .chat_requests import (
    _SAMPLING,
    LOGPROBS_MODES,
    BadRequest,
    _check_messages,
    _check_tools,
    _cut_stop,
    _norm,
    _prefix_digests,
    _Request,
    context_length,
    forward_log_probs,
    parse_request,
    stop_reason,
)
from .chat_tools import _SENTINEL, CHAT_TEMPLATES, ChatRenderer, parse_tool_calls

SEED_STRIDE = 1_000_003  # turn t of a conversation samples with seed + t * SEED_STRIDE
__all__ = ["BadRequest", "ChatServer", "Exchange"]


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
        self.context = max_context or context_length(backend)
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
        self._http = _HTTPServer(("127.0.0.1", port), handler_for(self))
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
        return parse_request(body, prompt_len=prompt_len, context=self.context, cap=self.max_tokens,
                             max_n=self.max_n, default_max=default_max, allowed=allowed)

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
        job = self._sample(prompt_ids, req)
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
                      "logprobs": self._logprobs(req, job, i, out) if req.logprobs else None,
                      "stop_reason": stop_reason(out, req.sampling.stop)}
            choices.append(choice)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": key, "choices": choices, "prompt_token_ids": list(prompt_ids),
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}

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

    # ---------------------------------------------------------------- sampling
    def _sample(self, prompt_ids: list[int], req: _Request) -> _Job:
        return self._run(_Job(prompt_ids, req.sampling, req.n, self._score_of(req)))

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
                    model = getattr(self.backend, "model", None)
                    job.scores = [forward_log_probs(model, job.prompt_ids, list(o.response_ids), *job.score)
                                  for o in job.outputs]
                except BadRequest as exc:
                    job.error = f"400 {exc}"
                except Exception as exc:  # noqa: BLE001
                    job.error = f"scoring failed: {type(exc).__name__}: {exc}"
            job.done.set()
