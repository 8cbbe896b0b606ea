"""The weights of a ``vllm_server`` run cross no trust boundary (reliability probe, turn 5: S13,
S14, S15, S16, S17), on a real ``python -m grpolab.rollout.vllm_serve serve`` process: every
route but ``/health`` refuses a request without the server's secret; the weight engine maps only
the handshake's file, owned by its user; a trainer killed with SIGKILL leaves nothing in
``/dev/shm`` and the server takes the next trainer; a second live trainer is refused in one line."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest

from grpolab.models import load_model_and_tokenizer
from grpolab.rollout import SamplingParams, make_backend
from grpolab.rollout.vllm_server_io import SECRET_HEADER, secret_file
from tests.vllm.test_vllm_server import LOGPROB_TOL, PROMPTS, hand_started_server, largest_gap, perturbed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def lm():
    return load_model_and_tokenizer("embedded:tiny", seed=0)


@pytest.fixture(scope="module")
def served(lm, tmp_path_factory):
    """A server started apart, as a user would (no secret given: it makes one and leaves it in
    ``$XDG_CACHE_HOME/grpolab/vllm-servers/``): (url, process, its secret)."""
    cache = tmp_path_factory.mktemp("cache")
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)  # this process's trainers (and their children) look there
    try:
        with hand_started_server(lm, tmp_path_factory.mktemp("served"), ("GRPOLAB_VLLM_SERVER_SECRET",)) as (
                url, proc, port):
            path = secret_file(port)
            assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
            yield url, proc, path.read_text().strip()
    finally:
        if saved is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = saved


def status(url: str, body=None, secret: str | None = None, method: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({SECRET_HEADER: secret} if secret else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def shm_weight_files() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("grpolab-weights-"))


TRAINER = textwrap.dedent("""
    import sys, time
    from grpolab.models import load_model_and_tokenizer
    from grpolab.rollout import make_backend
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    try:
        backend = make_backend("vllm_server", model, tok, server_url=sys.argv[1], timeout_s=120)
    except Exception as exc:
        print("ERROR", type(exc).__name__, exc, flush=True)
        sys.exit(2)
    print("SYNCED", backend._sender.path, flush=True)
    time.sleep(600)
""")


def start_trainer(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_S16_every_route_but_health_refuses_a_request_without_the_secret(served):
    url, _, secret = served
    assert status(url + "/health")[0] == 200
    planted = {"init_info": {"probe_path": "/tmp/x", "token": "t"}}
    for path, body in [("/init_weight_transfer_engine", planted), ("/start_weight_update", {}),
                       ("/update_weights", {"update_info": {"path": "/tmp/w"}}), ("/finish_weight_update", {}),
                       ("/collective_rpc", {"method": "sleep"}), ("/reset_prefix_cache", {}),
                       ("/v1/completions", {"model": "grpolab", "prompt": "hi", "max_tokens": 2})]:
        code, text = status(url + path, body)
        assert code == 401 and SECRET_HEADER in text, (path, code, text)
        assert status(url + path, body, secret="not-" + secret)[0] == 401
    assert status(url + "/v1/models")[0] == 401
    assert status(url + "/v1/models", secret=secret)[0] == 200


def test_S16_a_planted_weight_file_is_refused_even_with_the_secret(lm, served, tmp_path):
    """Another local user's file (here: owned by uid 65534, or readable by all) named in the weight
    routes is refused, and the served log-probs stay the trainer's."""
    model, tok = lm
    url, _, secret = served
    backend = make_backend("vllm_server", model, tok, server_url=url, timeout_s=120)
    try:
        noisy = perturbed(model, 0.3, seed=4)
        backend.sync_weights(noisy)
        shape = list(model.model.embed_tokens.weight.shape)
        planted = tmp_path / "weights"
        planted.write_bytes(bytes(shape[0] * shape[1] * 4))  # a zero embedding: uniform log-probs if loaded
        os.chmod(planted, 0o644)
        update = {"update_info": {"path": str(planted), "names": ["model.embed_tokens.weight"],
                                  "dtype_names": ["float32"], "shapes": [shape], "offsets": [0]}}
        assert status(url + "/start_weight_update", {}, secret)[0] == 200  # the whole protocol, as a planter would
        code, text = status(url + "/update_weights", update, secret)
        assert code >= 400, text
        status(url + "/finish_weight_update", {}, secret)  # the session ends (its outcome is vLLM's)
        probe = tmp_path / "probe"
        probe.write_text("tok")
        if os.getuid() == 0:
            os.chown(probe, 65534, 65534)
            code, text = status(url + "/init_weight_transfer_engine",
                                {"init_info": {"probe_path": str(probe), "token": "tok",
                                               "weights_path": str(planted)}}, secret)
            assert code >= 400, text
        out = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=10, seed=3))
        assert largest_gap(noisy, out, 1.0) <= LOGPROB_TOL  # the trainer's weights, not the planted zeros
    finally:
        backend.close()


def test_S17_a_killed_trainer_leaves_nothing_in_dev_shm_and_the_server_takes_the_next(lm, served):
    model, tok = lm
    url, proc, _ = served
    before = shm_weight_files()
    trainer = start_trainer(url)
    try:
        lines = [trainer.stdout.readline()]  # warnings may come first; the trainer sleeps once synced
        while lines[-1] and not lines[-1].startswith(("SYNCED", "ERROR")):
            lines.append(trainer.stdout.readline())
        assert lines[-1].startswith("SYNCED /proc/"), "".join(lines)
        assert shm_weight_files() == before  # S15: no file with a name while it trains
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    assert shm_weight_files() == before  # S17: nothing left after SIGKILL
    backend = make_backend("vllm_server", model, tok, server_url=url, timeout_s=120)  # S13: the next trainer
    try:
        out = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=10, seed=1))
        assert largest_gap(model, out, 1.0) <= LOGPROB_TOL
    finally:
        backend.close()
    assert proc.poll() is None


def test_S14_a_second_live_trainer_is_refused_in_one_line(lm, served):
    model, tok = lm
    url, _, _ = served
    backend = make_backend("vllm_server", model, tok, server_url=url, timeout_s=120)
    try:
        second = start_trainer(url)
        output, _ = second.communicate(timeout=300)
        assert second.returncode == 2 and "ERROR VLLMServerError" in output, output
        line = output.splitlines()[-1]
        assert "already has a trainer" in line and url in line
        out = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=10, seed=2))  # the first still samples
        assert largest_gap(model, out, 1.0) <= LOGPROB_TOL
    finally:
        backend.close()


def test_S13_a_weight_update_a_killed_trainer_left_open_does_not_block_the_next(lm, served):
    """A trainer killed between /start_weight_update and /finish_weight_update left the server
    refusing every later trainer (``start_weight_update called while a weight update is already
    active``) until it was restarted."""
    model, tok = lm
    url, _, secret = served
    backend = make_backend("vllm_server", model, tok, server_url=url, timeout_s=120)
    backend.close()  # its place is free, as a killed trainer's is
    assert status(url + "/start_weight_update", {}, secret)[0] == 200  # ... and it died here
    noisy = perturbed(model, 0.3, seed=5)
    backend = make_backend("vllm_server", noisy, tok, server_url=url, timeout_s=120)
    try:
        out = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=10, seed=6))
        assert largest_gap(noisy, out, 1.0) <= LOGPROB_TOL
    finally:
        backend.close()
