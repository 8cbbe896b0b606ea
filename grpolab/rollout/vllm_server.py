"""Rollouts from a vLLM server (``vllm serve``) in its own processes, over its HTTP API.

Where the colocated backend (``rollout.vllm``) runs the engine inside the trainer, this one talks
to a server: one grpolab starts (``server_url`` None: ``python -m grpolab.rollout.vllm_serve serve``
on a free port of 127.0.0.1, in its own process group, logging to a file of a temporary
directory; stopped by ``close``) or one already running at ``server_url`` (never stopped here).
What ``generate`` returns is exactly what the colocated backend returns (read its docstring): the
exact sampled ids, the sampler's ``processed_logprobs`` log-probs, finish reasons, stop strings,
``min_tokens`` rules, seeds ``base + p * n``, the too-long prompt error. One ``/v1/completions``
request per prompt (token ids in), sent together from a thread pool so the server batches them.

The server holds its own copy of the weights. It starts from the policy's config and tokenizer
only (``--load-format dummy``) and gets the weights with the first ``sync_weights``, as the
colocated engine does, through vLLM's weight-transfer protocol: ``/init_weight_transfer_engine``
once, then per sync ``/start_weight_update``, ``/update_weights`` (several chunks),
``/finish_weight_update`` and ``/reset_prefix_cache``. The bytes go by vLLM's NCCL engine on a CUDA
machine and by grpolab's shared-memory engine on a CPU (``vllm_serve``): an unnamed in-memory file
(memfd) of the trainer's that the server's worker maps through ``/proc``, so nothing is left in
``/dev/shm``; every route but ``/health`` needs the run's secret (``vllm_server_io``). Nothing holds
more than one parameter and a chunk buffer (``CHUNK_BYTES``, or one larger parameter).

Failures are one line, never a hang: every HTTP call has a timeout (``timeout_s``, the longest
the server may go without answering), and while it waits the backend checks that the server
process it started is alive; if it is not, ``VLLMServerError`` says the server at its URL died,
with its exit code and the last lines of its log.

CPU threads: the server's worker runs ``server_threads`` OpenMP threads (default 1), bound to the last
cores this process may use (``VLLM_CPU_OMP_THREADS_BIND``, when set, wins).

Under torchrun: rank 0 starts the server (or every rank connects to ``server_url``) and tells
the others its URL; every rank samples its own prompts through it; only rank 0 moves weights —
the other ranks still read the weight stream to its end (gathering a sharded parameter is a
collective) — and all ranks then wait for one another, so that none samples before the new
weights are in.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Sequence

import torch

from .base import Rollout, SamplingParams, model_end_ids, prompt_token_ids
from .vllm import _engine_dir
from .vllm_server_io import (  # noqa: F401 - VLLMServerError, check_vllm_server_options: this module's API
    SECRET_ENV,
    VLLMServerError,
    _free_port,
    _http,
    _kill_group,
    _NcclSender,
    _Refused,
    _server_threads_env,
    _SharedMemorySender,
    check_vllm_server_options,
    find_secret,
    new_secret,
    server_visible_devices,
)
from .vllm_server_parts import completion_rollout, refusal_hint, serve_command, server_root

LOG_TAIL_LINES = 6
POLL_S = 0.2  # how often a wait checks the server process


class VLLMServerBackend:
    """``generate(prompts, n, sampling)`` through a vLLM server's HTTP API; ``sync_weights(model,
    weights)`` after each update. The ``vllm_*`` knobs are the colocated backend's (passed to
    ``vllm serve`` when grpolab starts the server, ignored when it connects to ``server_url``);
    ``timeout_s``: the longest the server may take to start or go without answering;
    ``server_threads``: the server's CPU threads; ``max_concurrency``: requests in flight at once.
    ``max_batch_size`` and ``autocast_dtype`` are accepted for the common signature (vLLM batches)."""

    def __init__(self, model, tokenizer, *, generator: torch.Generator | None = None, max_batch_size: int = 256,
                 autocast_dtype=None, gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, enable_sleep_mode: bool = False, dtype: str = "float32",
                 cpu_kvcache_space_gib: int = 1, enforce_eager: bool | None = None, seed: int = 0,
                 server_url: str | None = None, timeout_s: float = 300.0, server_threads: int = 1,
                 max_concurrency: int = 64, device: str | None = None):
        check_vllm_server_options(server_url, enable_sleep_mode, tensor_parallel_size)
        if server_threads < 1:
            raise ValueError(f"server_threads must be >= 1, got {server_threads}")
        self.model, self.tokenizer, self.generator = model, tokenizer, generator
        # the sync canary's tolerance: a server started here holds ``dtype``; another's is not known here
        self.weights_dtype = getattr(torch, dtype) if server_url is None else torch.bfloat16
        self.timeout_s, self.sleep_mode, self._asleep = float(timeout_s), enable_sleep_mode, False
        self._stop_ids: dict[tuple[str, ...], dict[int, str]] = {}
        self._proc: subprocess.Popen | None = None
        self._dir, self._log_dir, self._sender, self._died = None, None, None, False
        self._secret = None  # the server's secret (``vllm_server_io``): made here for a server started here
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency + 2, thread_name_prefix="grpolab-vllm-http")
        dist = torch.distributed
        self._world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._rank = dist.get_rank() if self._world > 1 else 0
        self.last_sync_s = 0.0
        self._turn = threading.Lock()  # a generate and a sync never overlap on the server
        try:
            if server_url is None:
                url, error = None, None
                if self._rank == 0:
                    try:
                        url = self._start(model, tokenizer, gpu_memory_utilization=gpu_memory_utilization,
                                          max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                                          enable_sleep_mode=enable_sleep_mode, dtype=dtype,
                                          cpu_kvcache_space_gib=cpu_kvcache_space_gib, enforce_eager=enforce_eager,
                                          seed=seed, server_threads=server_threads, device=device)
                    except Exception as exc:  # every rank fails with the same line, none waits for a URL
                        error = exc
                url = self._share([url, None if error is None else f"{type(error).__name__}: {error}",
                                   self._secret], error)
            else:
                url = server_root(server_url)
                self._secret = find_secret(url)
            self.url = url
            info = self._call("GET", "/v1/models", None, "the model list")
            models = info.get("data") if isinstance(info, dict) else None
            if not models or not isinstance(models[0], dict) or "id" not in models[0]:
                raise VLLMServerError(f"the vLLM server at {url} serves no model (its /v1/models answer has no "
                                      f"entry): is vllm_server_url a vLLM server? It answered {str(info)[:120]!r}")
            served = models[0]
            self.served_model, self.max_model_len = served["id"], int(served.get("max_model_len") or 0) or None
            if self._rank == 0:
                self._sender = self._make_sender(server_url is None)
            self.sync_weights(model)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- the server process
    def _share(self, payload: list, error: Exception | None) -> str:
        """Rank 0's URL (or its failure) and its server's secret for every rank (the job's own processes)."""
        if self._world > 1:
            torch.distributed.broadcast_object_list(payload, src=0)
        url, message, self._secret = payload
        if error is not None:
            raise error
        if message is not None:
            raise VLLMServerError(f"rank 0 could not start the vLLM server: {message}")
        return url

    def _start(self, model, tokenizer, *, gpu_memory_utilization, max_model_len, tensor_parallel_size,
               enable_sleep_mode, dtype, cpu_kvcache_space_gib, enforce_eager, seed, server_threads,
               device: str | None = None) -> str:
        cuda = torch.cuda.is_available()
        self._dir = _engine_dir(model, tokenizer)
        self._log_dir = tempfile.mkdtemp(prefix="grpolab-vllm-server-")
        self.log_path = Path(self._log_dir) / "server.log"
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd, env = serve_command(self._dir.name, port, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                 gpu_memory_utilization=gpu_memory_utilization,
                                 tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
                                 enable_sleep_mode=enable_sleep_mode, device=device, cuda=cuda,
                                 cpu_kvcache_space_gib=cpu_kvcache_space_gib, server_threads=server_threads)
        self._secret = env[SECRET_ENV]
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)
        # a trainer that ends without close() still stops the server (at exit, or when collected)
        self._reaper = weakref.finalize(self, _kill_group, self._proc)
        self.url = url
        deadline = time.monotonic() + self.timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                self._died = True
                raise VLLMServerError(f"the vLLM server grpolab started at {url} exited with code {code} before "
                                      f"it was ready; {self._log_tail()}")
            try:
                _http(url + "/health", None, timeout=2.0)
                return url
            except (OSError, _Refused):
                pass
            if time.monotonic() > deadline:
                self._died = True  # its log stays: the error names it
                raise VLLMServerError(f"the vLLM server grpolab started at {url} was not ready within "
                                      f"{self.timeout_s:g} s (vllm_server_timeout_s); {self._log_tail()}")
            time.sleep(0.5)

    def _log_tail(self) -> str:
        try:
            lines = [" ".join(line.split()) for line in self.log_path.read_text(errors="replace").splitlines()]
        except OSError:
            return f"its log {self.log_path} cannot be read"
        tail = [line for line in lines if line][-LOG_TAIL_LINES:]
        return f"its log {self.log_path} ends: " + " | ".join(tail)

    def _make_sender(self, local: bool):
        if torch.cuda.is_available():
            workers = int(self._call("GET", "/get_world_size", None, "the world size")["world_size"])
            return _NcclSender(self._post, self._pool, workers, local)
        return _SharedMemorySender(self._post)

    # ---------------------------------------------------------------- HTTP with a watch on the server
    def _post(self, path: str, body: dict | None, what: str):
        return self._call("POST", path, body, what)

    def _call(self, method: str, path: str, body: dict | None, what: str):
        return self._wait([self._pool.submit(_http, self.url + path, body, self.timeout_s, method, self._secret)],
                          what)[0]

    def _wait(self, futures: list, what: str) -> list:
        """The futures' results; a VLLMServerError as soon as the server is dead or has answered
        nothing for ``timeout_s``."""
        pending, last = set(futures), time.monotonic()
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            for f in done:
                if f.exception() is not None:
                    for p in pending:
                        p.cancel()
                    raise self._failure(what, f.exception())
            now = time.monotonic()
            if done:
                last = now
            self._check_alive(what)
            if pending and now - last > self.timeout_s:
                for p in pending:
                    p.cancel()
                raise VLLMServerError(f"the vLLM server at {self.url} stopped answering: no reply to {what} in "
                                      f"{self.timeout_s:g} s (vllm_server_timeout_s)")
        return [f.result() for f in futures]

    def _check_alive(self, what: str) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self._died = True
            raise VLLMServerError(f"the vLLM server at {self.url} died (exit code {self._proc.returncode}) during "
                                  f"{what}; {self._log_tail()}")

    def _failure(self, what: str, exc: BaseException) -> Exception:
        if self._proc is not None:
            # a dead server's connection errors arrive before its exit status: give it a moment
            try:
                self._proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
            try:
                self._check_alive(what)
            except VLLMServerError as dead:
                return dead
        if isinstance(exc, _Refused):
            hint = refusal_hint(exc.status, what)
            return VLLMServerError(f"the vLLM server at {self.url} refused {what}: {exc}{hint}")
        if isinstance(exc, (OSError, urllib.error.URLError)):
            return VLLMServerError(f"the vLLM server at {self.url} stopped answering during {what} ({exc})")
        return exc if isinstance(exc, Exception) else RuntimeError(str(exc))

    # ---------------------------------------------------------------- weights
    def sync_weights(self, model, weights=None) -> None:
        """Send ``model``'s weights — or ``weights``, (name, tensor) pairs streamed one at a time, e.g.
        gathered from shards or merged with an adapter — to the server and drop its prefix cache.
        Rank 0 sends; the other ranks read the stream to its end; all wait for one another."""
        t0 = time.perf_counter()
        self.model = model
        if weights is None:
            weights = ((name, t.detach()) for name, t in model.state_dict().items())
        if self._sender is None:
            for _ in weights:  # gathering a sharded parameter is a collective: every rank takes part
                pass
        else:
            with self._turn:
                self._wake()
                self._sender.send(iter(weights))
                self._reset_prefix_cache()
        if self._world > 1:
            torch.distributed.barrier()  # no rank samples before the new weights are in
        self.last_sync_s = time.perf_counter() - t0

    def probe_log_probs(self, ids: Sequence[int]) -> list[float]:
        """The server's untempered log-probs of ``ids[1:]`` after their prefixes (vLLM's
        ``prompt_logprobs``): what the sync canary reads the served weights through (rank 0's server)."""
        body = dict(model=self.served_model, prompt=list(ids), max_tokens=1, temperature=1.0, prompt_logprobs=0)
        with self._turn:
            self._wake()
            out = self._post("/v1/completions", body, "the sync canary's probe")
            self.sleep()
        entries = out["choices"][0]["prompt_logprobs"][1:]
        return [float(e[str(t)]["logprob"]) for e, t in zip(entries, ids[1:])]

    def _reset_prefix_cache(self) -> None:
        for _ in range(50):  # it fails while blocks are held; nothing runs during a sync, so only briefly
            if (self._post("/reset_prefix_cache", None, "reset_prefix_cache") or {}).get("success", True):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the vLLM server at {self.url} would not reset its prefix cache after a weight sync")

    def _wake(self) -> None:
        if self._asleep:
            self._post("/wake_up", None, "wake_up")
            self._asleep = False

    def sleep(self) -> None:
        """GPU with ``enable_sleep_mode``: the server frees its KV cache and offloads its weights
        until the next sync or generate (rank 0 only; a no-op without sleep mode)."""
        if self.sleep_mode and not self._asleep and self._rank == 0:
            self._post("/sleep?level=1", None, "sleep")
            self._asleep = True

    def close(self) -> None:
        """Stop the server grpolab started (its whole process group) and remove its files; a server
        at ``server_url`` keeps running (its weight-transfer engine is released). Idempotent."""
        sender, self._sender = getattr(self, "_sender", None), None
        proc, self._proc = getattr(self, "_proc", None), None
        if sender is not None:
            if proc is None and getattr(self, "url", None):
                try:  # a server we connected to: free its transfer engine for the next trainer
                    _http(self.url + "/shutdown_weight_transfer_engine", {}, min(self.timeout_s, 10.0),
                          secret=self._secret)
                except Exception:
                    pass
            sender.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if proc is not None:
            self._reaper.detach()
            _kill_group(proc)
        if getattr(self, "_dir", None) is not None:
            self._dir.cleanup()
            self._dir = None
        log_dir, self._log_dir = getattr(self, "_log_dir", None), None
        if log_dir is not None and not self._died:  # a dead server's log stays where the error said
            import shutil

            shutil.rmtree(log_dir, ignore_errors=True)

    # ---------------------------------------------------------------- generation
    def end_ids(self) -> list[int]:
        return model_end_ids(self.model, self.tokenizer)

    def _single_token_stops(self, stops: Sequence[str]) -> dict[int, str]:
        key = tuple(stops)
        if key not in self._stop_ids:
            encoded = {s: self.tokenizer(s, add_special_tokens=False)["input_ids"] for s in stops}
            self._stop_ids[key] = {ids[0]: s for s, ids in encoded.items() if len(ids) == 1}
        return self._stop_ids[key]

    def _base_seed(self, sampling: SamplingParams) -> int:
        if sampling.seed is not None:
            return int(sampling.seed)
        return int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))

    def generate(self, prompts: Sequence[str], n: int, sampling: SamplingParams,
                 prompt_ids: Sequence[list[int]] | None = None) -> list[Rollout]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        ids = prompt_token_ids(self.tokenizer, prompts, prompt_ids)
        if ids and min(len(i) for i in ids) == 0:
            raise ValueError("an empty prompt cannot be continued")
        if self.max_model_len is not None:
            too_long = [i for i, p in enumerate(ids) if len(p) + sampling.max_tokens > self.max_model_len]
            if too_long:
                raise ValueError(f"prompt {too_long[0]} has {len(ids[too_long[0]])} tokens; with max_tokens "
                                 f"{sampling.max_tokens} it exceeds vllm_max_model_len {self.max_model_len}")
        single = self._single_token_stops(sampling.stop)
        end_ids = self.end_ids()
        base = self._base_seed(sampling)
        # vLLM refuses n > 1 at temperature 0: greedy groups are n requests of one (identical) sample
        per_request = 1 if sampling.temperature == 0 else n
        copies = n // per_request
        common = dict(model=self.served_model, n=per_request, temperature=sampling.temperature, top_p=sampling.top_p,
                      max_tokens=sampling.max_tokens, min_tokens=sampling.min_tokens, stop=list(sampling.stop),
                      stop_token_ids=end_ids + [i for i in single if i not in end_ids],
                      include_stop_str_in_output=True, logprobs=0, skip_special_tokens=True, return_token_ids=True,
                      return_tokens_as_token_ids=True)
        bodies = [dict(common, prompt=list(p), seed=base + i * n) for i, p in enumerate(ids) for _ in range(copies)]
        with self._turn:
            self._wake()
            futures = [self._pool.submit(_http, self.url + "/v1/completions", b, self.timeout_s, None, self._secret)
                       for b in bodies]
            outputs = self._wait(futures, f"a generate call of {len(futures)} requests")
            self.sleep()
        rollouts = []
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        for r, out in enumerate(outputs):
            p = r // copies
            choices = out.get("choices") if isinstance(out, dict) else None
            if not isinstance(choices, list) or len(choices) != per_request:
                raise VLLMServerError(f"the vLLM server at {self.url} answered a completion request of n="
                                      f"{per_request} with {len(choices) if isinstance(choices, list) else 'no'} "
                                      "choices: not a vLLM server grpolab can sample from")
            for c in choices:
                try:
                    rollouts.append(completion_rollout(prompts[p], ids[p], p, c, single, vocab))
                except (KeyError, TypeError, ValueError) as exc:
                    raise VLLMServerError(f"the vLLM server at {self.url} answered a completion grpolab cannot use "
                                          f"({type(exc).__name__}: {exc}): serve with python -m "
                                          "grpolab.rollout.vllm_serve serve (it returns token ids and "
                                          "processed log-probs)") from None
        return rollouts
