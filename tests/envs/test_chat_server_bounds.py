"""Issue 57 section 3 (../shared/probes/turn5/reliability-cases.md, C02-C15): the chat endpoint is a
bounded server. Prompts past the context are refused before anything is sampled (C10, C11); malformed
requests are one 400 line naming the field (C04-C07); ``n`` and the body are bounded and a stalled body
times out (C08, C09); a foreign Host or a missing API key is refused (C02); a bad request batched with
good ones fails alone (C14); popped exchanges are freed and kept ones bounded (C15); a long conversation
is keyed in linear work (C12); and a flood of 64 concurrent clients, good and bad, is served whole with
memory flat (C13)."""

import json
import resource
import socket
import subprocess
import threading

import pytest

import grpolab.envs.chat_requests as chat_requests
import grpolab.envs.chat_server as chat_server
from grpolab.envs.chat_server import ChatServer
from grpolab.models.tiny import build_tiny_model
from grpolab.rollout import HFRolloutBackend
from tests.helpers.chat_models import chat_tokenizer


class Counting(HFRolloutBackend):
    """The real HF backend, counting the prompts it samples."""

    prompts = 0

    def generate(self, prompts, *args, **kwargs):
        type(self).prompts += len(prompts)
        return super().generate(prompts, *args, **kwargs)


class Picky(HFRolloutBackend):
    """The real HF backend with one refusal of its own, as vLLM refuses a prompt past max_model_len: a
    prompt holding ``~`` fails the whole generate call it is batched into."""

    def generate(self, prompts, n, sampling, prompt_ids=None):
        if any(self.tokenizer.convert_tokens_to_ids("~") in ids for ids in prompt_ids or []):
            raise ValueError("a prompt holds '~'")
        return super().generate(prompts, n, sampling, prompt_ids=prompt_ids)


@pytest.fixture(scope="module")
def tiny():
    tok = chat_tokenizer()
    return build_tiny_model("tiny", tok, seed=0).eval(), tok


def post(url, body, headers=None, raw=None):
    """(status, parsed body) of a POST made with the standard library only."""
    import urllib.error
    import urllib.request

    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def chat(server, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("max_tokens", 2)
    return post(server.url + "/chat/completions", body)


def test_c10_c11_a_prompt_past_the_context_is_refused_before_sampling(tiny):
    model, tok = tiny
    with ChatServer(Counting(model, tok), tok) as server:
        before = Counting.prompts
        code, body = chat(server, messages=[{"role": "user", "content": "x" * 600}])
        assert code == 400 and "fills the model's context of 512" in body["error"]["message"]
        code, body = chat(server, messages=[{"role": "user", "content": "x" * 450}], max_tokens=100)
        assert code == 400 and "context is 512 tokens" in body["error"]["message"]
        assert Counting.prompts == before  # nothing was sampled
        assert chat(server)[0] == 200


BAD = [  # (request fields, the field the one line must name): C04, C06, C07
    ({"messages": [{"role": "user", "content": {"a": 1}}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": ["x"]}]}, "messages[0].tool_calls[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.7}, "max_tokens"), ({"max_tokens": "many"}, "max_tokens"),
    ({"n": 0}, "n"), ({"n": 1.9}, "n"), ({"n": -3}, "n"), ({"n": 17}, "n must be within [1, 16]"),
    ({"stop": {"a": 1}}, "stop"), ({"stop": [1, 2]}, "stop"), ({"stop": [""]}, "stop"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p"), ({"seed": 2 ** 70}, "seed"),
]


def test_c04_c09_a_malformed_request_is_one_400_line_naming_its_field(tiny):
    model, tok = tiny
    with ChatServer(HFRolloutBackend(model, tok), tok, max_body_bytes=4096, read_timeout_s=1.0) as server:
        answers = [(fields, name, *chat(server, **fields)) for fields, name in BAD]
        wrong = [(fields, code, body) for fields, name, code, body in answers
                 if code != 400 or name not in body["error"]["message"]]
        assert not wrong, wrong
        url = server.url + "/chat/completions"
        assert post(url, None, raw=b"x" * 5000)[0] == 413  # C09: over the body limit, not read
        port = int(server.url.split(":")[2].split("/")[0])
        with socket.create_connection(("127.0.0.1", port)) as s:  # C09: a body that never comes
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{")
            s.settimeout(30)
            assert s.recv(100) == b""  # the server gave up on it and closed
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n")
            s.settimeout(30)
            assert s.recv(100).startswith(b"HTTP/1.0 411")
        assert chat(server)[0] == 200


def test_c02_a_foreign_host_and_a_missing_api_key_are_refused(tiny):
    model, tok = tiny
    with ChatServer(HFRolloutBackend(model, tok), tok, api_key="s3cret") as server:
        url = server.url + "/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert post(url, body)[0] == 401
        assert post(url, body, {"Authorization": "Bearer s3cret", "Host": "attacker.example"})[0] == 403
        assert post(url, body, {"Authorization": "Bearer s3cret"})[0] == 200
        import urllib.request

        with urllib.request.urlopen(server.url[:-3] + "/health", timeout=30) as resp:  # health needs no key
            assert resp.status == 200


def test_c14_a_failing_request_fails_alone(tiny):
    model, tok = tiny
    with ChatServer(Picky(model, tok), tok, batch_wait_s=1.0) as server:
        results = {}

        def one(text):
            results[text] = chat(server, messages=[{"role": "user", "content": text}])

        threads = [threading.Thread(target=one, args=(t,)) for t in ("hello", "bad ~", "world")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results["hello"][0] == 200 and results["world"][0] == 200
    assert results["bad ~"][0] == 500 and "a prompt holds '~'" in results["bad ~"][1]["error"]["message"]


def test_c15_popped_exchanges_are_freed_and_kept_ones_bounded(tiny):
    model, tok = tiny
    with ChatServer(HFRolloutBackend(model, tok), tok, max_exchanges=8) as server:
        for i in range(12):
            assert chat(server, model=f"policy@{i}")[0] == 200
            if i < 6:
                assert len(server.exchanges(f"policy@{i}", pop=True)) == 1
        assert server.held() == 6  # 6 popped, 6 kept
        for i in range(12, 20):
            chat(server, model=f"policy@{i}")
        assert server.held() == 8 and server.exchanges("policy@19") and not server.exchanges("policy@6")


def test_c12_a_long_conversation_is_keyed_in_linear_work(tiny, monkeypatch):
    model, tok = tiny
    calls = []
    norm = chat_server._norm
    for module in (chat_server, chat_requests):  # where the endpoint keys messages
        monkeypatch.setattr(module, "_norm", lambda m: calls.append(1) or norm(m))
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(401)]
    with ChatServer(HFRolloutBackend(model, tok), tok, max_context=100_000) as server:
        assert chat(server, messages=messages, max_tokens=1)[0] == 200
    assert len(calls) <= 2 * len(messages)  # a dump of the whole history per assistant message was 40,000


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20


def test_c13_a_flood_of_64_concurrent_clients_is_served_whole_with_memory_flat(tiny):
    """Three rounds of 64 simultaneous connections (the multi-turn driver's batch), one in eight a bad
    request (past the context, over the body limit, malformed): every good one is answered 200, every bad
    one 4xx, the listen backlog holds them all, and the process's memory does not grow with the rounds."""
    model, tok = tiny
    with ChatServer(HFRolloutBackend(model, tok), tok, max_exchanges=64, max_body_bytes=64 * 1024) as server:
        port = int(server.url.split(":")[2].split("/")[0])
        ss = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True)
        if ss.returncode == 0 and ss.stdout.split():
            assert int(ss.stdout.split()[2]) >= 1024  # the listen backlog (Send-Q of a listening socket)
        bad = [{"messages": [{"role": "user", "content": "x" * 600}]}, {"messages": "x" * 70_000},
               {"messages": [{"role": "user", "content": "hi"}], "n": 1000}]
        rss = []
        for round_ in range(3):
            barrier, results = threading.Barrier(64), [None] * 64

            def one(i):
                body = bad[i // 8 % 3] if i % 8 == 7 else {"model": f"policy@{round_}-{i}",
                                                             "messages": [{"role": "user", "content": f"Q{i}"}]}
                barrier.wait()
                results[i] = chat(server, **body)[0]

            threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert [r for i, r in enumerate(results) if i % 8 != 7] == [200] * 56
            assert all(400 <= r < 500 for i, r in enumerate(results) if i % 8 == 7), results
            rss.append(_rss_mb())
            assert server.held() <= 64
    assert rss[2] - rss[0] < 30, rss  # flat: the kept exchanges are bounded


def test_c13_c11_a_multi_turn_rollout_past_the_context_fails_with_its_cause_named(capsys):
    """The verifiers driver through the endpoint: a model of 40 positions cannot take the game's prompt
    plus 12 tokens, so each rollout fails with the endpoint's 400 (it sampled past the context before),
    and the warning names verifiers' ModelError and its cause (it read 'rollout failed:' and nothing)."""
    pytest.importorskip("verifiers", reason="verifiers is not installed (pip install -e '.[envs]')")
    from tests.envs.test_vf_turns import run_game

    tok = chat_tokenizer()
    model = build_tiny_model("tiny", tok, seed=0, max_position_embeddings=40).eval()
    _, out = run_game(model, tok, n=1)
    assert all(r.info["env_errors"] == 1 for r in out)
    lines = [line for line in capsys.readouterr().err.splitlines() if "rollout failed" in line]
    assert len(lines) == 3 and all("ModelError <- BadRequestError" in line and "context of 40 tokens" in line
                                   for line in lines), lines


def test_c02_a_runs_endpoint_serves_only_the_runs_own_client(tiny):
    """C02 in a run: the endpoint a multi-turn verifiers run starts had no key, so any local process that
    found its port drove the training policy. Now a per-run key only the driver's client holds: a request
    without it is a 401, the run's own rollouts are served (test_vf_turns runs them)."""
    pytest.importorskip("verifiers", reason="verifiers is not installed (pip install -e '.[envs]')")
    from grpolab.envs.vf import build_vf_env
    from tests.envs.test_vf_turns import GAME

    model, tok = tiny
    driver = build_vf_env(GAME, {}, tokenizer=tok, max_total_tokens=80)
    try:
        server = driver._server(HFRolloutBackend(model, tok))
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert post(server.url + "/chat/completions", body)[0] == 401
        assert post(server.url + "/chat/completions", body, {"Authorization": "Bearer grpolab"})[0] == 401
        assert post(server.url + "/chat/completions", body, {"Authorization": f"Bearer {server.api_key}"})[0] == 200
    finally:
        driver.close()
