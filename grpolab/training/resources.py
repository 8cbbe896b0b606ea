"""Resources bounded up front: every prompt must fit the model's context with room for the
response, and the rollout's KV cache must fit the memory the machine has — checked after the
model is loaded and before the run directory is touched, so a run that cannot work fails in one
line instead of hours later."""

from __future__ import annotations

import os
import sys

import torch

from ..data import DataError
from ..data.prompts.chat import check_system_prompt_fits
from ..envs import EnvSettings
from ..rewards.reward_model import load_reward_models


def context_length(model) -> int | None:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def prompt_lengths(examples: list, template, tokenizer) -> list[int]:
    prompts = [template.format(e.question) for e in examples]
    return [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]] if prompts else []


def check_prompt_lengths(examples: list, template, tokenizer, model, max_new_tokens: int, on_error: str = "raise",
                         lengths: list[int] | None = None) -> list:
    """Examples whose prompt plus ``max_new_tokens`` fits the model's context. A longer one is an
    error naming where it came from (``file:line``), or — with ``on_error="skip"`` — dropped,
    counted and reported once on stderr. ``lengths``: the prompts' token counts, if known."""
    limit = context_length(model)
    if limit is None or not examples:
        return examples
    lengths = lengths if lengths is not None else prompt_lengths(examples, template, tokenizer)
    kept, dropped = [], []
    for example, n in zip(examples, lengths):
        if n + max_new_tokens <= limit:
            kept.append(example)
            continue
        where = (getattr(example, "meta", None) or {}).get("source", "a training example")
        problem = (f"{where}: the prompt is {n} tokens; with sampling_max_tokens {max_new_tokens} it exceeds the "
                   f"model's context of {limit} tokens")
        if on_error != "skip":
            raise DataError(problem + " (shorten it, lower sampling_max_tokens, or set data_on_error: skip)")
        dropped.append(problem)
    if dropped:
        print(f"grpolab: skipped {len(dropped)} example(s) whose prompt does not fit the context; first: {dropped[0]}",
              file=sys.stderr)
    if not kept:
        raise DataError(f"no example fits the model's context of {limit} tokens: {dropped[0]}")
    return kept


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rollout_memory_bytes(model, rows: int, tokens: int) -> int:
    """Estimated peak memory of sampling ``rows`` sequences of ``tokens`` tokens: the KV cache
    (2 x layers x kv heads x head dim per token) plus one row of logits per sequence, in the
    model's dtype and float32 respectively."""
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 1)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 1)
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    width = next(model.parameters()).element_size()
    kv = 2 * layers * kv_heads * head_dim * width * rows * tokens
    logits = 4 * rows * getattr(cfg, "vocab_size", 1)
    return kv + logits


def check_rollout_memory(
    model, device: torch.device, max_batch_size: int, longest_prompt: int, max_new_tokens: int
) -> None:
    """Refuse a rollout batch whose KV cache cannot fit the free memory (``GRPOLAB_MEMORY_BYTES``
    overrides the detected amount, e.g. to plan for another machine)."""
    override = os.environ.get("GRPOLAB_MEMORY_BYTES")
    free = int(override) if override else available_memory_bytes(device)
    need = rollout_memory_bytes(model, max_batch_size, longest_prompt + max_new_tokens)
    if free is not None and need > free:
        raise DataError(
            f"sampling {max_batch_size} sequences of up to {longest_prompt + max_new_tokens} tokens needs about "
            f"{need / 2**30:.1f} GiB for the KV cache, but {device} has {free / 2**30:.1f} GiB free: lower "
            "rollout_max_batch_size or sampling_max_tokens"
        )


def fit_default_max_tokens(cfg, limit: int | None, longest_prompt: int) -> None:
    """A ``sampling_max_tokens`` left at its default (1024, CS336's) that the model's context cannot hold
    after the longest prompt (the embedded tiny model's 512) is lowered to what fits, said on stderr:
    the defaults run together. A value the config sets is kept (and checked as given)."""
    if limit is None or "sampling_max_tokens" in cfg.model_fields_set or longest_prompt >= limit:
        return
    room = limit - longest_prompt
    if cfg.sampling_max_tokens > room:
        print(f"grpolab: sampling_max_tokens {cfg.sampling_max_tokens} (the default) does not fit the model's context "
              f"of {limit} tokens after a {longest_prompt}-token prompt: {room} instead (set sampling_max_tokens "
              "to choose)", file=sys.stderr)
        cfg.sampling_min_tokens = min(cfg.sampling_min_tokens, room)
        cfg.sampling_max_tokens = room


def check_sampled_inputs(inputs, cfg, check_train: bool = True):
    """The ``Run`` hook of a trainer that samples: prompts fit the context (training and
    validation examples; too-long ones are an error, or skipped with ``data_on_error: skip``), the
    reward models load (``load_reward_models``) and the rollout batch fits memory. Returns
    ``check(model, tokenizer, device)``."""

    def check(model, tokenizer, device) -> None:
        limit, longest = context_length(model), 0
        env = getattr(cfg, "env", None)
        default = EnvSettings.model_fields["max_total_tokens"].default
        env_tokens = None if env is None else env.get("max_total_tokens", default)
        if limit is not None and env_tokens is not None and env_tokens >= limit:  # tools: prompt + turns must fit too
            raise DataError(f"env.max_total_tokens ({env_tokens}) must be below the model's context of {limit} tokens "
                            "(the prompt, the model's turns and the observations share it)")
        names = ("train", "evals") if check_train else ("evals",)
        all_lengths = {name: prompt_lengths(getattr(inputs, name), inputs.template, tokenizer) for name in names}
        fit_default_max_tokens(cfg, limit, max((n for ls in all_lengths.values() for n in ls), default=0))
        if check_train:  # a system prompt too long for any question is named, not data line 1 (SFT checks its own)
            check_system_prompt_fits(inputs.template, tokenizer, limit, cfg.sampling_max_tokens, "sampling_max_tokens")
        for name in names:
            examples = getattr(inputs, name)
            lengths = all_lengths[name]  # tokenised once for both checks
            setattr(inputs, name, check_prompt_lengths(examples, inputs.template, tokenizer, model,
                                                       cfg.sampling_max_tokens, cfg.data_on_error, lengths))
            fitting = [n for n in lengths if limit is None or n + cfg.sampling_max_tokens <= limit]
            longest = max([longest, *fitting])
        # the reward models, opened now (before the run directory is touched) and kept for scoring
        load_reward_models(inputs.reward, getattr(inputs, "eval_reward", None), device=device)
        if longest:
            check_rollout_memory(model, device, cfg.rollout_max_batch_size, longest, cfg.sampling_max_tokens)

    return check


# ---------------------------------------------------------------- CPU threads

def _probe_seconds(threads: int, repeats: int = 3, calls: int = 30) -> float:
    """Best wall time of ``calls`` decode-sized matmuls (64 x 576 by 576 x 1536, many short parallel
    regions, as a sampling step has) with ``threads`` torch threads."""
    import time

    torch.set_num_threads(threads)
    # not the global generator: a seeded run draws the same with or without a probe
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=g), torch.randn(1536, 576, generator=g)
    for _ in range(3):  # the thread pool started and warm
        torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return best


def choose_cpu_threads(threads: int | None, probe: bool = True, measure=_probe_seconds) -> tuple[int, str | None]:
    """The torch thread count for a CPU run, and the line that says how it was chosen (None when
    nothing was chosen here). ``threads`` given: that. ``OMP_NUM_THREADS`` set: torch's count as it
    is; so with ``probe`` false (deterministic runs, torchrun ranks). Otherwise a probe of ~0.1 s
    times 1 thread against every core and keeps the faster: OpenMP threads spin while they wait, so
    on a machine where other processes hold cores, all cores can be several times slower than one
    (measured on 2 cores with one busy: a SmolLM2 decode step 719 ms with 2 threads, 313 ms with 1;
    quiet: 206 ms with 2). The probed count follows the load, so two runs of one config may use
    different counts (float results differ in the last bits): set ``threads`` for bit-identical
    reruns and resumes (``deterministic: true`` does not probe)."""
    if threads is not None:
        torch.set_num_threads(threads)
        return threads, None
    every = torch.get_num_threads()
    if not probe or os.environ.get("OMP_NUM_THREADS") or every <= 1:
        return every, None
    timings = {t: measure(t) for t in (1, every)}
    chosen = min(timings, key=lambda t: timings[t])
    torch.set_num_threads(chosen)
    shown = ", ".join(f"{t} thread{'s' * (t > 1)} {1000 * s:.1f} ms" for t, s in timings.items())
    return chosen, (f"torch threads: {chosen} (probe: {shown}; set threads in the config or OMP_NUM_THREADS "
                    "to choose)")


# ---------------------------------------------------------------- CPU memory: freed blocks kept

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
KEPT_FREE_BYTES = 1 << 30  # the heap's free top is handed back to the kernel only beyond this
GLIBC_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")


def keep_freed_memory(libc_name: str | None = "libc.so.6") -> bool:
    """glibc: every block from the process heap (none from a fresh ``mmap``) and freed ones kept
    there for reuse, for the rest of the process. glibc's defaults give each block over 32 MB (a
    SmolLM2 head gradient: 113 MB) fresh pages that the kernel zeroes on first touch, one fault per
    4 KiB, and hand them back on free; an update re-touches them every micro-batch (measured on 2
    AVX2 cores: 0.6 M faults and 2.2-3.4 s of system time per 32-row update, against 0-0.06 M and
    0.2-0.7 s kept; ``make bench-real``'s update 9.5-10.0 -> 8.9 s, peak RSS
    unchanged). True when glibc took the settings; False elsewhere (musl,
    macOS, Windows: their allocators are left as they are) and where the environment already tunes
    glibc's malloc (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``' ``glibc.malloc.*``): that choice wins."""
    import ctypes
    import os

    if any(k in os.environ for k in GLIBC_MALLOC_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False

    try:
        libc = ctypes.CDLL(libc_name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES))


# ---------------------------------------------------------------- dtype: auto

# below this many parameters a step is bound by per-op overhead, not matmuls (the embedded 0.9M/9.5M
# models): bf16 autocast's casts cost more than its matmuls save
BF16_MIN_PARAMS = 30_000_000
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo: AMX tiles, AVX-512 BF16 dot products
BF16_MUST_BEAT = 0.8  # bf16 is kept only when its probe takes under 0.8x fp32's time


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere: fp32 is then kept)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def model_shape(model) -> tuple[int, int, int]:
    """(parameters, hidden size, MLP width) of a model, for the dtype probe."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 256
    width = getattr(config, "intermediate_size", None) or 4 * hidden
    return sum(p.numel() for p in model.parameters()), int(hidden), int(width)


def _bf16_probe_seconds(hidden: int, width: int, rows: int = 256, repeats: int = 3) -> tuple[float, float]:
    """Best seconds of an MLP-sized ``F.linear`` (``rows`` x ``hidden`` by ``width`` x ``hidden``, both
    ways) in fp32, and the same under bf16 autocast on fp32 tensors (the casts included, as a run pays)."""
    import time

    g = torch.Generator().manual_seed(0)  # not the global generator: a seeded run draws the same with a probe
    x, w = torch.randn(rows, hidden, generator=g), torch.randn(width, hidden, generator=g)
    up = torch.randn(rows, width, generator=g)

    def once() -> None:
        torch.nn.functional.linear(x, w)
        torch.nn.functional.linear(up, w.t())

    def best(bf16: bool) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            once()  # warm: the kernels chosen, the thread pool up
            seconds = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                once()
                seconds = min(seconds, time.perf_counter() - t)
        return seconds

    return best(False), best(True)


def choose_dtype(dtype: str, device, shape: tuple[int, int, int], *, flags: set[str] | None = None,
                 measure=_bf16_probe_seconds, cuda_bf16=None) -> tuple[str, str | None]:
    """The run's dtype, and the line that says how ``auto`` chose it (None for a dtype given).

    ``auto``: bfloat16 (autocast; the weights, logits and log-softmax stay fp32) on a GPU that
    supports it; on a CPU, for a model of at least ``BF16_MIN_PARAMS`` parameters, only where the
    CPU has native bf16 (AMX or AVX-512 BF16) *and* a ~0.1 s probe at the model's MLP shapes runs
    bf16 in under ``BF16_MUST_BEAT`` of fp32's time; float32 everywhere else (an AVX2 CPU emulates
    bf16 matmuls, ~8x slower). ``shape`` is ``model_shape(model)``; ``flags``, ``measure`` and
    ``cuda_bf16`` default to this machine's (tests pass their own); ``measure=None``: no probe, the
    flags decide."""
    if dtype != "auto":
        return dtype, None
    device = torch.device(device)
    params, hidden, width = shape
    if device.type == "cuda":
        ok = (cuda_bf16 or torch.cuda.is_bf16_supported)()
        return ("bfloat16", "dtype auto: bfloat16 (the GPU supports it; logits and log-softmax in fp32)") if ok \
            else ("float32", "dtype auto: float32 (this GPU has no bf16)")
    if device.type != "cpu":
        return "float32", f"dtype auto: float32 (on {device.type})"
    if params < BF16_MIN_PARAMS:
        return "float32", (f"dtype auto: float32 ({params / 1e6:.1f}M parameters: a step this small is bound by "
                           "per-op overhead, not matmuls)")
    native = [f for f in NATIVE_BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if not native:
        return "float32", ("dtype auto: float32 (this CPU has no bf16 instructions, AMX or AVX-512 BF16: "
                           "bf16 is emulated)")
    if measure is None:  # no probe (torchrun ranks must agree, deterministic runs rerun alike): the flags decide
        return "bfloat16", f"dtype auto: bfloat16 ({native[0]}, not probed; logits and log-softmax in fp32)"
    fp32_s, bf16_s = measure(hidden, width)
    probe = f"probe at {hidden}x{width}: fp32 {1000 * fp32_s:.1f} ms, bf16 {1000 * bf16_s:.1f} ms"
    if bf16_s < BF16_MUST_BEAT * fp32_s:
        return "bfloat16", f"dtype auto: bfloat16 ({native[0]}; {probe}; logits and log-softmax in fp32)"
    return "float32", f"dtype auto: float32 ({native[0]}, but bf16 does not pay here: {probe})"


def adopt_saved_dtype(cfg, saved: dict) -> None:
    """``--resume`` with ``dtype: auto``: the dtype the run's start chose (its saved config), with the
    fp32 head that choice brought, so the run continues as it began and is not probed again."""
    if getattr(cfg, "dtype", None) == "auto" and saved.get("dtype") in ("float32", "bfloat16"):
        cfg.dtype = saved["dtype"]
        if cfg.dtype == "bfloat16":
            cfg.logits_fp32 = saved.get("logits_fp32", cfg.logits_fp32)
