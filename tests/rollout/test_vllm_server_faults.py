"""``rollout_backend: vllm_server`` against servers that are not what it expects (reliability
probe, turn 5, cases S02-S10, S12, S15, S17): a real HTTP server on 127.0.0.1 answers as a broken or
foreign server would, and every mistake is one ``VLLMServerError`` line naming the server's URL
(and the fix), never a traceback; the weight buffer has no name in ``/dev/shm``; stale weight
files of dead trainers are removed. No vLLM is needed: the backend's side only."""

from __future__ import annotations

import json
import os
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpolab.rollout import SamplingParams
from grpolab.rollout.vllm_server import VLLMServerBackend, VLLMServerError
from grpolab.rollout.vllm_server_io import remove_stale_weight_files


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def _handler(mode: str, seen: list):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, body, content_type="application/json"):
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            seen.append(("GET", self.path, None))
            if mode == "notvllm" or (mode == "rooted" and not self.path.startswith("/v1/")):
                return self._send(404, b"<html>Not Found</html>", "text/html")
            if mode == "html":
                return self._send(200, b"<html><body>hello</body></html>", "text/html")
            if self.path.startswith("/v1/models"):
                return self._send(200, {"data": [] if mode == "nodata" else [{"id": "grpolab", "max_model_len": 512}]})
            return self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            seen.append(("POST", self.path, body))
            if mode == "wrongmodel" and self.path == "/update_weights":  # S12: vLLM's answer to another shape
                return self._send(500, {"error": "Call to collective_rpc method failed: Worker failed with error ''"})
            if not self.path.startswith("/v1/completions"):
                return self._send(200, {"success": True})
            n, k = body["n"], 3
            choice = {"text": "abc", "token_ids": [5] * k, "logprobs": {"token_logprobs": [-1.0] * k},
                      "finish_reason": "length"}
            if mode == "badcompl":
                del choice["token_ids"]
            if mode == "oov":
                choice["token_ids"] = [10**9] * k
            if mode == "negid":
                choice["token_ids"] = [-4] * k
            if mode == "nanlp":
                choice["logprobs"]["token_logprobs"] = [float("nan")] * k
            choices = [dict(choice) for _ in range(1 if mode == "fewchoices" else n)]
            return self._send(200, {"choices": choices})

    return Handler


@pytest.fixture
def fake_server():
    """``start(mode) -> (url, requests seen)``: a stand-in vLLM server on a free port of 127.0.0.1."""
    servers = []

    def start(mode: str):
        seen: list = []
        server = _Server(("127.0.0.1", 0), _handler(mode, seen))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", seen

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def lm():
    from grpolab.models import load_model_and_tokenizer

    return load_model_and_tokenizer("embedded:tiny", seed=0)


def _one_line_error(lm, url: str, *, generate: bool = False) -> str:
    model, tok = lm
    with pytest.raises(VLLMServerError) as caught:
        backend = VLLMServerBackend(model, tok, server_url=url, timeout_s=10)
        try:
            if generate:
                backend.generate(["1+2="], 4, SamplingParams(max_tokens=3))
        finally:
            backend.close()
    message = str(caught.value)
    assert "\n" not in message and url.rstrip("/").removesuffix("/v1") in message
    return message


@pytest.mark.parametrize("mode, expected", [
    ("notvllm", "HTTP 404"),  # S02: a server that is not vLLM
    ("html", "not JSON"),  # S03: 200 with an HTML page
    ("nodata", "serves no model"),  # S04: an empty model list
])
def test_a_server_that_is_not_vllm_is_one_line_naming_its_url(lm, fake_server, mode, expected):
    """S02, S03, S04: before, a RuntimeError/IndexError traceback or a bare JSON error."""
    url, _ = fake_server(mode)
    message = _one_line_error(lm, url)
    assert expected in message and "vllm_server_url" in message


@pytest.mark.parametrize("mode, expected", [
    ("badcompl", "no token_ids"),  # S06
    ("oov", "outside the model's vocabulary"),  # S07
    ("negid", "outside the model's vocabulary"),  # S07
    ("fewchoices", "with 1 choices"),  # S08
    ("nanlp", "finite log-prob"),  # S09
])
def test_completions_grpolab_cannot_use_are_one_line_naming_the_server(lm, fake_server, mode, expected):
    """S06-S09: before, KeyError / IndexError in the forward / a shape error in the advantages /
    every step skipped on NaN log-probs, the server never named."""
    url, _ = fake_server(mode)
    assert expected in _one_line_error(lm, url, generate=True)


def test_S12_a_server_of_another_model_refusing_the_weights_is_one_line_saying_so(lm, fake_server):
    """S12: a server started for another model answers the weight update with vLLM's bare 500
    ("Worker failed with error ''"); it was a RuntimeError traceback naming neither the cause nor the
    fix. Now one line naming the server, the refused update and what to check."""
    message = _one_line_error(lm, fake_server("wrongmodel")[0])
    assert "refused update_weights: HTTP 500" in message and "does the server serve this run's model" in message


def test_a_url_ending_in_v1_is_the_servers_root(lm, fake_server):
    """S10: an OpenAI base URL (``.../v1``) was a 404 traceback; it now reaches the server's root."""
    model, tok = lm
    url, seen = fake_server("rooted")
    backend = VLLMServerBackend(model, tok, server_url=url + "/v1/", timeout_s=10)
    try:
        assert backend.url == url
        out = backend.generate(["1+2="], 2, SamplingParams(max_tokens=3))
        assert len(out) == 2 and out[0].response_ids == [5, 5, 5]
    finally:
        backend.close()
    assert ("POST", "/v1/completions") in [(m, p) for m, p, _ in seen]


def test_the_weight_buffer_has_no_name_in_dev_shm_and_is_this_users_alone(lm, fake_server):
    """S15, S17: the weights went to a 0644 file ``/dev/shm/grpolab-weights-<pid>-*`` that every
    local user could read, and that a killed trainer left behind. Now a memfd: nothing in
    ``/dev/shm``, and the server is sent ``/proc/<pid>/fd/<n>``, which only this user can open."""
    model, tok = lm
    url, seen = fake_server("ok")
    backend = VLLMServerBackend(model, tok, server_url=url, timeout_s=10)
    try:
        init = next(body for _, path, body in seen if path == "/init_weight_transfer_engine")["init_info"]
        update = next(body for _, path, body in seen if path == "/update_weights")["update_info"]
        assert update["path"] == init["weights_path"] == f"/proc/{os.getpid()}/fd/{backend._sender.fd}"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"grpolab-weights-{os.getpid()}")]
        st = os.stat(update["path"])
        assert st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode) and st.st_size >= 4 * 2**20
    finally:
        backend.close()


def test_stale_weight_files_of_dead_trainers_are_removed(tmp_path):
    """S17: files an earlier release's killed trainer left are removed when a sender starts; a live
    process's file stays."""
    dead = 2**22 + 12345  # above pid_max's default: no such process
    stale = tmp_path / f"grpolab-weights-{dead}-0123456789ab"
    stale_probe = tmp_path / f"grpolab-weights-{dead}-0123456789ab.probe"
    live = tmp_path / f"grpolab-weights-{os.getpid()}-0123456789ab"
    other = tmp_path / "grpolab-weights-notapid"
    for path in (stale, stale_probe, live, other):
        path.write_bytes(b"x")
    removed = remove_stale_weight_files(str(tmp_path))
    assert sorted(removed) == sorted([str(stale), str(stale_probe)])
    assert live.exists() and other.exists() and not stale.exists()
