"""The parts of ``VLLMServerBackend`` (``rollout.vllm_server``) that need no live server: the command and
environment that start one, its root URL, the hint an HTTP refusal gets, and a completion choice read
as a ``Rollout`` (token ids inside the vocabulary, one finite log-prob per token, or one error naming
what is wrong)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from .base import Rollout
from .vllm_server_io import SECRET_ENV, _server_threads_env, new_secret, server_visible_devices

SERVED_NAME = "grpolab"
# set for a server grpolab starts: each of its processes dies with its parent (``vllm_serve``)
DIE_WITH_PARENT_ENV = "GRPOLAB_VLLM_DIE_WITH_PARENT"


def serve_command(model_dir: str, port: int, *, dtype, seed, max_model_len, gpu_memory_utilization,
                  tensor_parallel_size, enforce_eager, enable_sleep_mode, device, cuda, cpu_kvcache_space_gib,
                  server_threads) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of the server grpolab starts on 127.0.0.1:``port``; the
    environment carries the run's new secret (``SECRET_ENV``: a command line is public)."""
    cmd = [sys.executable, "-m", "grpolab.rollout.vllm_serve", "serve", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
           "--load-format", "dummy", "--dtype", dtype, "--seed", str(seed),
           "--gpu-memory-utilization", str(gpu_memory_utilization),
           "--tensor-parallel-size", str(tensor_parallel_size),
           "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
           "--disable-uvicorn-access-log"]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if (not cuda) if enforce_eager is None else enforce_eager:
        cmd += ["--enforce-eager"]
    if enable_sleep_mode:
        cmd += ["--enable-sleep-mode"]
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env[SECRET_ENV] = new_secret()  # in its environment: a command line is public
    env[DIE_WITH_PARENT_ENV] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_space_gib))
    # the server imports the grpolab this process runs
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    if device is not None:  # vllm_device: the server sees that GPU alone (none for cpu)
        env["CUDA_VISIBLE_DEVICES"] = server_visible_devices(device)
    if not cuda:
        _server_threads_env(env, server_threads)
    return cmd, env


def server_root(url: str) -> str:
    """A server's root URL: no trailing slash, and an OpenAI base URL's ``/v1`` dropped (S10)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def refusal_hint(status: int, what: str) -> str:
    """What to do about an HTTP refusal of the server, by its status."""
    if status == 401:
        return (" (the server needs its secret: a server started apart with python -m grpolab.rollout.vllm_serve "
                "serve leaves it for its own user in ~/.cache/grpolab/vllm-servers/; run the trainer as that user "
                "or set GRPOLAB_VLLM_SERVER_SECRET)")
    if status in (200, 404):  # a page that is not JSON, a route it does not have
        return (" (is vllm_server_url the root of a vLLM server started with python -m grpolab.rollout.vllm_serve "
                "serve, such as http://127.0.0.1:8000?)")
    if "weight" in what and status >= 500:
        return (" (does the server serve this run's model? It must be started on the policy's config and "
                "tokenizer, and serve one trainer at a time)")
    return ""


def completion_rollout(prompt: str, prompt_ids: list[int], index: int, c: dict, single: dict[int, str],
             vocab: int | None = None) -> Rollout:
    """One ``/v1/completions`` choice as a Rollout; a choice grpolab cannot use raises KeyError/ValueError."""
    if "token_ids" not in c or not isinstance(c.get("logprobs"), dict):
        raise KeyError("no token_ids" if "token_ids" not in c else "no logprobs")
    response_ids = [int(t) for t in c["token_ids"]]
    logprobs = [float(lp) for lp in c["logprobs"]["token_logprobs"]]
    bad = [t for t in response_ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary of {vocab}: does the server serve "
                         "this run's model?")
    if len(logprobs) != len(response_ids) or not all(math.isfinite(lp) and lp <= 0 for lp in logprobs):
        raise ValueError(f"{len(logprobs)} log-probs for {len(response_ids)} tokens, or one not a finite log-prob "
                         f"(e.g. {next((lp for lp in logprobs if not math.isfinite(lp) or lp > 0), None)})")
    text, stop_reason = c["text"], c.get("stop_reason")
    if c["finish_reason"] == "length":
        reason = "length"
    elif isinstance(stop_reason, str) or stop_reason in single:
        reason = "stop"
        if stop_reason in single and not text.endswith(single[stop_reason]):
            text += single[stop_reason]  # a special stop token is skipped in the text: keep it
    else:
        reason = "eos"
    return Rollout(prompt=prompt, response=text, prompt_ids=list(prompt_ids), response_ids=response_ids,
                   logprobs=logprobs, finish_reason=reason, prompt_index=index)
