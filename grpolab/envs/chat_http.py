"""The chat endpoint's HTTP side (``chat_server``): the routes and their checks (Host, API key, body size
and read timeout, requests in flight), the answers of ``/v1/completions``, ``/tokenize``,
``/detokenize`` and ``/v1/models``, and an answer as server-sent ``chunk`` events under ``stream``."""

from __future__ import annotations

import json
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .chat_requests import (
    _SAMPLING,
    MAX_TOP_LOGPROBS,
    BadRequest,
    _check_messages,
    _check_tools,
    _cut_stop,
    _int,
    _offsets,
    _utf8,
    stop_reason,
)


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024  # the multi-turn driver opens a whole rollout batch at once (C13: 5 lost 41 of 64)
    daemon_threads = True


def text_complete(server, body: dict) -> dict:
    """The ``text_completion`` answer to a ``/v1/completions`` body: a prompt as text or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _utf8(prompt, "prompt")
        prompt_ids = server.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and
                                                     0 <= t < len(server.tokenizer) for t in prompt):
        prompt_ids = list(prompt)
    else:
        raise BadRequest("prompt must be a non-empty string or a list of token ids (one prompt per request)")
    lp = body.get("logprobs")
    if lp is not None:
        lp = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    body = {k: v for k, v in body.items() if k not in ("logprobs", "prompt")}
    if lp is not None:
        body.update(logprobs=True, top_logprobs=lp)
    req = server._request(body, len(prompt_ids), 16, _SAMPLING)  # OpenAI's default max_tokens for completions
    job = server._sample(prompt_ids, req)
    choices = []
    for i, out in enumerate(job.outputs):
        text = out.response if req.keep_stop else _cut_stop(out.response, req.sampling.stop)
        logprobs = None
        if req.logprobs:
            entries = server._logprobs(req, job, i, out)["content"]
            logprobs = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                        "text_offset": _offsets(entries)}
        choices.append({"index": i, "text": text, "finish_reason": "length" if out.finish_reason == "length"
                        else "stop", "logprobs": logprobs, "token_ids": list(out.response_ids),
                        "stop_reason": stop_reason(out, req.sampling.stop)})
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or server.model_name, "choices": choices, "prompt_token_ids": prompt_ids,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens}}

def tokenize(server, body: dict) -> dict:
    """vLLM's ``/tokenize``: ``{"prompt": text}`` or ``{"messages": [...]}`` -> the ids the model would read."""
    if body.get("messages") is not None:
        messages = _check_messages(body["messages"])
        renderer = server._renderer(_check_tools(body.get("tools")))
        add = body.get("add_generation_prompt", True)
        ids = server.tokenizer(renderer.render(messages, bool(add)), add_special_tokens=False)["input_ids"]
    elif isinstance(body.get("prompt"), str):
        _utf8(body["prompt"], "prompt")
        ids = server.tokenizer(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))[
            "input_ids"]
    else:
        raise BadRequest("/tokenize needs prompt (a string) or messages")
    return {"count": len(ids), "max_model_len": server.context, "tokens": ids, "token_strs": None}

def detokenize(server, body: dict) -> dict:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                               0 <= t < len(server.tokenizer) for t in tokens):
        raise BadRequest("tokens must be a list of token ids of this model")
    return {"prompt": server.tokenizer.decode(tokens)}

def models(server) -> dict:
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                        "owned_by": "grpolab", "root": server.model_name, "parent": None,
                                        "max_model_len": server.context}]}


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
                                         "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
                                         "token_ids": c["token_ids"]}]})
    if include_usage:
        out.append({**base, "choices": [], "usage": answer["usage"]})
    return out


def _text_chunks(answer: dict, include_usage: bool) -> list[dict]:
    base = {"id": answer["id"], "object": "text_completion", "created": answer["created"], "model": answer["model"]}
    out = [{**base, "choices": [{**c, "finish_reason": None, "stop_reason": None, "token_ids": []}]}
           for c in answer["choices"]]
    out += [{**base, "choices": [{"index": c["index"], "text": "", "logprobs": None,
                                  "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
                                  "token_ids": c["token_ids"]}]}
            for c in answer["choices"]]
    if include_usage:
        out.append({**base, "choices": [], "usage": answer["usage"]})
    return out


class _Handler(BaseHTTPRequestHandler):
    """The routes; ``chat`` is the ``ChatServer`` (``handler_for``)."""

    chat: Any = None

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
        if auth and self.chat.api_key is not None and \
                self.headers.get("Authorization") != f"Bearer {self.chat.api_key}":
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
            self._send(200, models(self.chat))
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
        if size > self.chat.max_body_bytes:
            self._error(413, f"the request body has {size} bytes, over this server's limit of "
                        f"{self.chat.max_body_bytes}")
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
        routes = {"/v1/chat/completions": (self.chat.complete, _chunks),
                  "/v1/completions": (lambda body: text_complete(self.chat, body), _text_chunks),
                  "/tokenize": (lambda body: tokenize(self.chat, body), None),
                  "/detokenize": (lambda body: detokenize(self.chat, body), None)}
        if path not in routes:
            return self._error(404, f"no route {self.path}", "not_found")
        if self._refused():
            return
        if not self.chat._in_flight.acquire(blocking=False):
            return self._error(503, f"the endpoint is busy: {self.chat.max_in_flight} requests in flight",
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
            self.chat._in_flight.release()

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



def handler_for(server) -> type:
    """The request handler class of one ``ChatServer``."""
    return type("Handler", (_Handler,), {"chat": server, "timeout": server.read_timeout_s})
