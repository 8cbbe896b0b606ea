"""An OpenAI-compatible chat endpoint over grpolab's sampler, for environments and agent harnesses
that want to call "a model" during a rollout: ``POST /v1/chat/completions`` (and ``GET /v1/models``)
on 127.0.0.1 only.

A request's messages (and ``tools``) are rendered by the tokenizer's chat template and sampled by
the run's backend (the training model itself under ``hf``). Concurrent requests are batched: the
first waits ``batch_wait_s`` for others, and each set of equal sampling settings is one
``generate`` call. The answer is OpenAI's ``chat.completion`` object plus vLLM's token fields:
``prompt_token_ids``, ``choices[i].token_ids``, and ``logprobs.content`` entries whose ``token``
is ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``). With ``tools``, calls are parsed
from the model's syntax (``chat_tools.parse_tool_calls``) into ``message.tool_calls``.

Exact ids across turns. A request whose messages repeat a completion this server returned (the
same earlier messages, then that assistant message) continues from exactly the ids sampled then:
its prompt ids are that turn's prompt and completion ids, then the template's text for what
follows it, tokenised once (``ChatRenderer.after_turn``). So the ids of a whole conversation are
one sequence in which every model turn is the sampled ids. ``exchanges(key)`` returns what was
served under a request's ``model`` name (a driver gives each rollout its own, ``policy@<key>``). A
request's ``seed`` is offset by the number of completions already served under its name, so the
turns of one conversation never replay one random stream.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..rollout import SamplingParams
from .chat_tools import _SENTINEL, ChatRenderer, parse_tool_calls

SEED_STRIDE = 1_000_003  # turn t of a conversation samples with seed + t * SEED_STRIDE


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
    done: threading.Event = field(default_factory=threading.Event)
    outputs: list = field(default_factory=list)
    error: str | None = None


def _norm(message: dict) -> str:
    """A message as compared across requests: role, text and calls (arguments parsed), nothing else."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append([fn.get("name"), args])
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return json.dumps([message.get("role"), content or "", calls], sort_keys=True)


def _for_template(message: dict) -> dict:
    """An OpenAI message as chat templates read it: tool-call arguments as objects, not JSON strings."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = dict(call.get("function", {}))
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


class ChatServer:
    """``with ChatServer(backend, tokenizer) as server: server.url`` (``http://127.0.0.1:PORT/v1``)."""

    def __init__(self, backend, tokenizer, *, chat_template: str | None = None, port: int = 0,
                 batch_wait_s: float = 0.02, max_tokens: int = 256, host: str = "127.0.0.1"):
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"the chat endpoint listens on 127.0.0.1 only, not {host!r}: it runs the policy unguarded")
        self.backend, self.tokenizer, self.chat_template = backend, tokenizer, chat_template
        self.batch_wait_s, self.max_tokens = batch_wait_s, max_tokens
        self._jobs: queue.Queue = queue.Queue()
        self._served: dict[str, tuple[Exchange, str]] = {}
        self._by_key: dict[str, list[Exchange]] = {}
        self._lock = threading.Lock()
        self._renderers: dict[str, ChatRenderer] = {}
        self._http = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._http.daemon_threads = True
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
        """What was served under the model name ``key``, in order (``pop``: and forget it)."""
        with self._lock:
            return self._by_key.pop(key, []) if pop else list(self._by_key.get(key, []))

    # ---------------------------------------------------------------- requests
    def _renderer(self, tools: list[dict] | None) -> ChatRenderer:
        key = json.dumps(tools or [], sort_keys=True)
        if key not in self._renderers:
            renderer = ChatRenderer(self.tokenizer, list(tools or []), self.chat_template)
            if tools:
                renderer.check()
            else:
                probe = [{"role": "user", "content": "Q"}]
                turn = renderer.render(probe + [{"role": "assistant", "content": _SENTINEL}], with_tools=False)
                renderer._end_of_turn = turn[turn.index(_SENTINEL) + len(_SENTINEL):] if _SENTINEL in turn else ""
            self._renderers[key] = renderer
        return self._renderers[key]

    def _prompt(self, messages: list[dict], renderer: ChatRenderer) -> tuple[list[int], bool, bool]:
        """(prompt ids, chained, exact): continuing the latest served turn these messages repeat, if any."""
        text = renderer.render(messages, True)
        for k in range(len(messages) - 1, 0, -1):
            if messages[k].get("role") != "assistant":
                continue
            with self._lock:
                hit = self._served.get(self._served_key(messages[:k], messages[k], renderer))
            if hit is None:
                continue
            served, _ = hit
            history, assistant, following = messages[:k], _for_template(served.message), messages[k + 1:]
            sampled = self.tokenizer.decode(served.completion_ids, skip_special_tokens=False)
            glue, exact = renderer.after_turn(history, assistant, following, sampled)
            ids = self.tokenizer(glue, add_special_tokens=False)["input_ids"]
            return served.prompt_ids + served.completion_ids + ids, True, exact
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], False, True

    @staticmethod
    def _served_key(history: list[dict], assistant: dict, renderer: ChatRenderer) -> str:
        return json.dumps([[_norm(m) for m in history], _norm(assistant), len(renderer.schemas)])

    def complete(self, body: dict) -> dict:
        """The ``chat.completion`` answer to a request body (``ValueError``: a bad request, one line)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        messages = [_for_template(m) for m in messages]
        tools = body.get("tools") or None
        renderer = self._renderer(tools)
        prompt_ids, chained, exact = self._prompt(messages, renderer)
        key, choices = str(body.get("model") or "policy"), []
        sampling = _sampling(body, self.max_tokens)
        if sampling.seed is not None:  # a harness sends one seed for every turn: each turn draws its own stream
            with self._lock:
                sampling.seed += SEED_STRIDE * len(self._by_key.get(key, []))
        job = _Job(prompt_ids, sampling, int(body.get("n") or 1))
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise RuntimeError(job.error)
        for i, out in enumerate(job.outputs):
            content, calls = parse_tool_calls(out.response, self.tokenizer, renderer.schemas) if tools else \
                (out.response, [])
            good = [c for c in calls if c.problem is None]
            message = {"role": "assistant", "content": content if good else out.response}
            if good:
                message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": {
                    "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in good]
            finish = "tool_calls" if good else ("length" if out.finish_reason == "length" else "stop")
            ex = Exchange(key, messages, list(prompt_ids), list(out.response_ids), list(out.logprobs), out.response,
                          finish, message, chained, exact)
            with self._lock:
                self._by_key.setdefault(key, []).append(ex)
                self._served[self._served_key(messages, message, renderer)] = (ex, key)
            choices.append({"index": i, "message": message, "finish_reason": finish, "token_ids": ex.completion_ids,
                            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                                                      "top_logprobs": []}
                                                     for t, lp in zip(ex.completion_ids, ex.logprobs)]}})
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": key, "choices": choices, "prompt_token_ids": list(prompt_ids),
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}

    # ---------------------------------------------------------------- sampling
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
            for j in jobs:
                groups.setdefault(repr((j.sampling, j.n)), []).append(j)
            for group in groups.values():
                self._generate(group)

    def _generate(self, jobs: list[_Job]) -> None:
        n = jobs[0].n
        try:
            outs = self.backend.generate([""] * len(jobs), n, jobs[0].sampling, prompt_ids=[j.prompt_ids for j in jobs])
            for i, job in enumerate(jobs):
                job.outputs = outs[i * n:(i + 1) * n]
        except Exception as exc:  # noqa: BLE001 - the request gets the error, the server keeps serving
            for job in jobs:
                job.error = f"sampling failed: {type(exc).__name__}: {exc}"
        for job in jobs:
            job.done.set()


def _sampling(body: dict, cap: int) -> SamplingParams:
    """The request's sampling settings (OpenAI names), checked; ``max_tokens`` at most ``cap``."""
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    asked = body.get("max_completion_tokens", body.get("max_tokens")) or cap
    try:
        return SamplingParams(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                              max_tokens=min(int(asked), cap), stop=stop,
                              seed=None if body.get("seed") is None else int(body["seed"]))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad sampling settings: {exc}") from None


def _handler(server: ChatServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet: a rollout makes many requests
            pass

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the request body must be a JSON object")
                self._send(200, server.complete(body))
            except (ValueError, json.JSONDecodeError) as exc:
                self._send(400, {"error": {"message": " ".join(str(exc).split()), "type": "invalid_request_error"}})
            except Exception as exc:  # noqa: BLE001 - one line to the client, the server stays up
                self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error"}})

    return Handler
