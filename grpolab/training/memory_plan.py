"""``grpolab plan``: per-rank memory of a run, estimated from its config and the model's shape
(``config.json`` only: nothing is loaded or downloaded), and whether it fits.

What a rank holds is what grpolab's own code allocates (``run_model.py``, ``distributed.py``, ``core/logprobs.py``):

- the training weights in float32 (``dtype: bfloat16`` is autocast over fp32 weights), whole under none/DDP/ZeRO-1/2,
  ``1/world`` of them under FSDP2 and ZeRO-3; every ZeRO stage also keeps an fp32 master copy of its partition
  (DeepSpeed clones it even from fp32 weights);
- gradients of the trainable parameters (fp32; sharded like the weights under FSDP2/ZeRO-2/3; ZeRO-1 keeps them whole
  and copies its partition's out; DDP keeps a second copy in its all-reduce buckets) and AdamW's two fp32 moments
  (sharded by FSDP2 and every ZeRO stage, not by DDP); under LoRA only the adapters train;
- the sampler's plain copy of the full weights (``RunModel.replica``) whenever the training weights are sharded or
  adapted, and the hf sampler's fused q/k/v and gate/up weights (``fast_decoder``; under bf16 also, through the
  rollout only, a bf16 copy of every matmul weight); ZeRO's gradient reduce bucket (``reduce_bucket_size`` with
  ``contiguous_gradients``, whole on a GPU; two with ZeRO-1/2's ``overlap_comm``); and the frozen reference
  (``kl_coef``/``beta`` > 0; LoRA: none, the adapter off); on a CPU a bf16 LoRA run's fp32 checkpoint stays mapped;
- one micro-batch's activations (every tensor a decoder layer saves for its backward; with gradient checkpointing only
  each layer's input, plus one layer recomputed) and the log-prob buffers (the head runs ``LOGITS_CHUNK_BYTES`` of
  float32 logits at a time);
- the rollout: the hf backend's KV cache, or the colocated vLLM engine (``vllm_gpu_memory_utilization`` of the GPU:
  its weights, the rest KV cache; with sleep mode it is freed during the update); on a CPU its weights plus
  ``vllm_cpu_kvcache_space_gib``.

The peak is the largest of five phases, one function each over the rank's ``RankMemory``:
set-up (the whole model is loaded, and copied for the sampler, before it is sharded), rollout, update (gradients and
activations live), the optimizer step (AdamW's foreach temporaries beside the gradients), and the weight sync after it
(the full weights gathered from the shards; merged W + BA under LoRA). The model's shape and the hardware are
``plan_inputs.py``'s. Validated against measured peak RSS of real CPU runs (tests/scale/test_memory_plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.logprobs import LOGITS_CHUNK_BYTES
from .config import ConfigError, load_yaml_file
from .plan_inputs import (
    GiB,
    Hardware,
    MiB,
    ModelShape,
    check_prompt_tokens,
    longest_prompt,
    model_shape,
    zero_bucket,
    zero_options,
)

# Beyond the modelled terms: a CUDA context with the allocator's slack (a typical figure, not measured
# here), or a CPU process that has imported torch and transformers (measured here: ~350 MB).
OVERHEAD = {"gpu": 1.0 * GiB, "cpu": 350 * MiB}


@dataclass
class Plan:
    """Per-rank bytes of each term, the phases' peaks and the verdict."""

    shape: ModelShape
    shape_source: str
    hw: Hardware
    notes: list[str] = field(default_factory=list)
    terms: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    micro_batch_rows: int = 1
    seq_len: int = 1
    max_micro_batch: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """The modelled peak of a rank (without the process/CUDA overhead)."""
        return max(self.phases.values())

    @property
    def total(self) -> int:
        return self.peak + OVERHEAD[self.hw.kind]

    @property
    def fits(self) -> bool:
        return self.total <= self.hw.memory


@dataclass
class RankMemory:
    """What one rank of ``cfg``'s run holds across its phases (bytes), and what decides it: the terms
    every phase shares, the sampler's, and the micro-batch's sequence length."""

    shape: ModelShape
    world: int
    stage: int  # ZeRO stage (0: not DeepSpeed)
    sharded_params: bool  # FSDP2, ZeRO-3: each rank holds 1/world of the weights
    lora: bool
    bf16: bool  # autocast: bf16 matmuls over fp32 weights
    vllm: bool
    lora_fraction: float = 0.0  # of the weights the adapters cover (merged at each sync)
    shell: bool = False  # LoRA on whole weights (none/DDP): the sampler's copy owns only its merged layers
    weights: int = 0
    gradients: int = 0
    kept_gradients: int = 0  # of ``gradients``, what ZeRO keeps between steps (its partition)
    optimizer: int = 0  # AdamW's two fp32 moments
    step_temp: int = 0  # torch's AdamW (foreach): one temporary per state tensor
    replica: int = 0
    reference: int = 0
    bucket: int = 0
    engine: int = 0  # the vLLM engine's weights
    kv_cache: int = 0
    fused: int = 0  # the hf sampler's fused q/k/v, gate/up
    cast: int = 0  # the hf sampler's bf16 copies of the matmul weights under bf16 autocast (rollout only)
    mapped: int = 0  # CPU: pages of the fp32 checkpoint file still mapped after its adapted layers were cast
    asleep: bool = False  # vLLM sleep mode (level 1) during the update: weights offloaded, KV cache freed
    seq: int = 1

    @property
    def persistent(self) -> int:
        """What lives through every phase after set-up (ZeRO keeps its gradient partitions too)."""
        return (self.weights + self.replica + self.fused + self.bucket + self.reference + self.optimizer
                + self.kept_gradients + self.mapped)

    @property
    def merged_bytes(self) -> int:
        """The adapted layers' weights in the compute dtype (LoRA: bf16 under bf16 autocast, else fp32)."""
        return (2 if self.bf16 else 4) * int(self.shape.n_params * self.lora_fraction)

    @property
    def live_gradients(self) -> int:
        """The gradients an update and the optimizer step add (ZeRO's partition is in ``persistent``)."""
        return self.gradients - self.kept_gradients

    @property
    def resident_engine(self) -> int:
        """The vLLM engine as it stays through the update (nothing of it asleep; the hf sampler's KV
        cache is freed after the rollout)."""
        return 0 if self.asleep else self.engine + (self.kv_cache if self.vllm else 0)

    def update_extra(self, rows: int, checkpointing: bool) -> int:
        """What an update adds on top of the persistent state for micro-batches of ``rows``: the
        activations, the log-prob buffers, and the layers gathered from the shards."""
        s = self.shape
        tokens = rows * self.seq
        acts = tokens * s.activation_bytes_per_token(checkpointing, self.bf16)
        chunk = min(tokens, max(1, LOGITS_CHUNK_BYTES // (4 * s.vocab_size)))
        logits = 3 * chunk * s.vocab_size * 4  # logits, log-softmax, softmax for the entropy (float32)
        gathered = 0
        if self.sharded_params and self.world > 1:  # one layer whole at a time (and the next one prefetched)
            layer = (s.n_params - s.vocab_size * s.hidden_size) // s.num_hidden_layers
            gathered = 2 * 4 * layer
        return acts + logits + gathered


def _resident(cfg, shape: ModelShape, hw: Hardware, notes: list[str]) -> RankMemory:
    """The terms every phase shares: weights, gradients, AdamW, the sampler's copy, the reference,
    ZeRO-3's gradient bucket."""
    world = hw.ranks if cfg.distributed != "none" else 1
    if cfg.distributed == "none" and hw.ranks > 1:
        notes.append(f"distributed is none: one process uses one of the {hw.ranks} devices")
    zero = zero_options(cfg)
    stage = zero["stage"]
    sharded_params = cfg.distributed == "fsdp2" or stage == 3
    # ZeRO-1 partitions the optimizer states, ZeRO-2 the gradients too, ZeRO-3 and FSDP2 the weights too
    state_share = world if sharded_params or stage else 1
    grad_share = world if sharded_params or stage >= 2 else 1
    P, lora, gpu = shape.n_params, cfg.lora_r > 0, hw.kind == "gpu"
    trainable = shape.lora_params(cfg.lora_r, cfg.lora_target_modules) if lora else P
    m = RankMemory(shape, world, stage, sharded_params, lora, bf16=getattr(cfg, "dtype", "float32") == "bfloat16",
                   vllm=getattr(cfg, "rollout_backend", "hf") == "vllm")
    if lora:
        m.lora_fraction = shape.lora_weight_fraction(cfg.lora_target_modules)
    m.weights = 4 * P // (world if sharded_params else 1)
    m.shell = lora and cfg.distributed in ("none", "ddp")
    if m.shell:  # the adapted layers' frozen base in the compute dtype (bf16: half), the rest fp32
        adapted = int(P * m.lora_fraction)
        m.weights = 4 * (P - adapted) + m.merged_bytes
        if m.bf16 and not gpu and shape.checkpoint_fp32:
            # CPU: the fp32 tensors left (embeddings, norms) view the safetensors mmap, so the adapted layers'
            # pages read when cast stay resident (/proc/self/smaps: 72 MB of the 19M model's 76 MB file, busy
            # 2-core AVX-512-BF16 EPYC; not measured for a bf16 file, which is converted on load: taken as 0)
            m.mapped = 4 * adapted
    if stage:
        # every ZeRO stage's fp32 master partition beside the parameters' (stage_1_and_2.py's
        # single_partition_of_fp32_groups, a clone even of fp32 weights; stage3.py's fp32 partition)
        m.weights += 4 * trainable // world
    # a plain full copy of the weights when the trained ones are sharded or adapted: the hf sampler's, and with vLLM
    # still kept for validation and final/ (the engine's weights stream from the shards); LoRA on whole weights:
    # only the merged adapted layers, in the compute dtype (the rest is shared)
    m.replica = m.merged_bytes if m.shell else 4 * P if (lora or sharded_params) else 0
    kl = getattr(cfg, "kl_coef", 0) > 0 or cfg.needs_reference
    m.reference = 4 * P if kl and not lora else 0
    m.optimizer = 8 * trainable // state_share
    m.gradients = 4 * trainable // grad_share
    if stage:
        m.kept_gradients = 4 * trainable // world
    if stage == 1:  # whole gradients through the backward; this rank's partition copied out of them
        m.gradients += m.kept_gradients
    if cfg.distributed == "ddp" and world > 1:
        m.gradients *= 2  # DDP's all-reduce buckets hold a second copy of every gradient
    m.bucket = zero_bucket(zero, trainable, gpu)
    m.step_temp = 4 * trainable // state_share  # AdamW steps this rank's partition of the states
    if cfg.fsdp_cpu_offload and gpu:  # FSDP2 CPU offload: shards, their gradients and AdamW live in host memory
        notes.append("fsdp_cpu_offload: the weight shards, gradients and optimizer states are in host memory")
        m.weights = m.gradients = m.kept_gradients = m.optimizer = m.step_temp = 0
    return m


def _micro_batch(cfg, m: RankMemory, prompt_tokens: int | None, notes: list[str], source: str = "") -> int:
    """Rows of one micro-batch on a rank; sets ``m.seq`` (the longest prompt plus the new tokens)."""
    new_tokens = getattr(cfg, "sampling_max_tokens", 0)
    context = m.shape.max_position_embeddings
    if prompt_tokens is not None:
        check_prompt_tokens(prompt_tokens, new_tokens, context, source)
        notes.append(f"longest prompt: {prompt_tokens} tokens (--prompt-tokens)")
    else:
        prompt_tokens = longest_prompt(cfg)
        if prompt_tokens is None:
            max_len = getattr(cfg, "vllm_max_model_len", None)
            prompt_tokens = max_len - new_tokens if max_len and max_len > new_tokens else 512
            notes.append(f"prompts taken as {prompt_tokens} tokens: the data or tokenizer is not on this machine "
                         "(--prompt-tokens to change)")
        else:
            notes.append(f"longest prompt: {prompt_tokens} tokens (--prompt-tokens to change)")
    if prompt_tokens + new_tokens > context:
        notes.append(f"{prompt_tokens} prompt + {new_tokens} new tokens (sampling_max_tokens) exceed the model's "
                     f"context of {context}: sequences planned as {context} tokens (the run refuses such a prompt)")
    m.seq = min(prompt_tokens + new_tokens, context)
    rows_per_rank = math.ceil(cfg.train_batch_size / m.world)
    rows = math.ceil(rows_per_rank / max(1, getattr(cfg, "gradient_accumulation_steps", 1)))
    return rows * cfg.rows_per_example


def _sampler(cfg, m: RankMemory, hw: Hardware, notes: list[str]) -> None:
    """The rollout's own terms: the colocated vLLM engine (its weights and KV cache), or the hf
    backend's fused weights and KV cache."""
    s = m.shape
    if m.vllm:
        vdtype = cfg.vllm_dtype if cfg.vllm_dtype != "auto" else getattr(cfg, "dtype", "float32")
        vbytes = 2 if vdtype in ("bfloat16", "float16") else 4
        m.engine = vbytes * s.n_params // cfg.vllm_tensor_parallel_size
        if hw.kind == "gpu":
            m.kv_cache = max(0, int(cfg.vllm_gpu_memory_utilization * hw.memory) - m.engine)
        else:
            m.kv_cache = cfg.vllm_cpu_kvcache_space_gib * GiB
        per_token = s.kv_bytes_per_token(vbytes) // cfg.vllm_tensor_parallel_size
        notes.append(f"vLLM KV cache: {m.kv_cache // max(1, per_token):,} tokens "
                     f"({m.kv_cache // max(1, per_token * m.seq)} sequences of {m.seq})")
    elif hasattr(cfg, "sampling_max_tokens"):
        m.fused = s.fused_sampler_bytes() // (2 if m.shell and m.bf16 else 1)  # fused from the bf16 merged copy
        m.cast = s.cast_sampler_bytes(head=not getattr(cfg, "logits_fp32", False)) if m.bf16 else 0
        batch = min(getattr(cfg, "rollout_max_batch_size", 256),
                    math.ceil(getattr(cfg, "rollout_batch_size", getattr(cfg, "train_batch_size", 1)) / m.world))
        m.kv_cache = batch * m.seq * s.kv_bytes_per_token(2 if m.bf16 else 4) + batch * s.vocab_size * 4
    m.asleep = m.vllm and hw.kind == "gpu" and cfg.vllm_enable_sleep_mode


# ---------------------------------------------------------------- the phases: each one's peak per rank


def setup_peak(m: RankMemory) -> int:
    """Set-up, before the vLLM engine is built: the whole model loaded in fp32 (and copied for the
    sampler and the reference) before any sharding."""
    if m.shell:  # the fp32 model loaded, then each adapted layer's copy made as its fp32 base is cast
        return max(4 * m.shape.n_params, m.weights + m.replica + m.mapped) + m.reference
    return 4 * m.shape.n_params + m.replica + m.reference


def rollout_peak(m: RankMemory) -> int:
    """The rollout: the vLLM engine, or the hf sampler's KV cache and fused weights (rebuilt beside the
    old), and under bf16 its bf16 weight copies."""
    return m.persistent + (m.engine + m.kv_cache if m.vllm else m.kv_cache + m.fused + m.cast)


def update_peak(m: RankMemory, rows: int, checkpointing: bool) -> int:
    """The update: gradients, one micro-batch's activations and log-prob buffers, beside the engine."""
    return m.persistent + m.live_gradients + m.update_extra(rows, checkpointing) + m.resident_engine


def optimizer_step_peak(m: RankMemory) -> int:
    """The optimizer step: AdamW's foreach temporaries beside the gradients."""
    return m.persistent + m.live_gradients + m.step_temp + m.resident_engine


def weight_sync_peak(m: RankMemory) -> int:
    """The weight sync after the step: the full weights gathered from the shards (ZeRO-3 clones them
    too; into vLLM one layer at a time), merged W + BA under LoRA; the engine awake to take them (its
    KV cache still freed under sleep mode)."""
    s, sync = m.shape, 0
    P = s.n_params
    if m.sharded_params and m.world > 1 and not m.vllm:
        sync = 4 * P * (2 if m.stage == 3 else 1)
    elif m.sharded_params and m.world > 1:  # one layer at a time
        sync = 4 * (P - s.vocab_size * s.hidden_size) // s.num_hidden_layers
    if m.lora and m.shell:  # merged W + BA one layer at a time (in fp32, then rounded)
        sync += int(6 * P * m.lora_fraction) // s.num_hidden_layers
    elif m.lora and not m.vllm:
        sync += int(4 * P * m.lora_fraction)  # merged W + BA, beside them
    return m.persistent + sync + (m.engine + (0 if m.asleep else m.kv_cache) if m.vllm else 0)


def phase_peaks(m: RankMemory, rows: int, checkpointing: bool) -> dict[str, int]:
    return {"set-up": setup_peak(m), "rollout": rollout_peak(m), "update": update_peak(m, rows, checkpointing),
            "optimizer step": optimizer_step_peak(m), "weight sync": weight_sync_peak(m)}


def _largest_micro_batch(m: RankMemory, budget: int, checkpointing: bool) -> int:
    """The most rows per micro-batch whose every phase fits ``budget`` (0: not even one), up to 2^16."""
    def fits(rows: int) -> bool:
        return max(phase_peaks(m, rows, checkpointing).values()) <= budget

    best, n = 0, 1
    while n <= 1 << 16 and fits(n):
        best, n = n, n * 2
    lo, hi = best, min(n, 1 << 16)
    while best and hi - lo > 1:  # binary search between the last power of two that fits and the next
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo if best else 0


def estimate(cfg, hw: Hardware, architecture: str | None = None, prompt_tokens: int | None = None) -> Plan:
    """The memory plan of ``cfg`` (any trainer's config) on ``hw``: the terms, each phase's peak, and
    the largest micro-batch that fits (also with gradient checkpointing, when the run has it off)."""
    shape, source = model_shape(cfg.model, architecture)
    plan = Plan(shape, source, hw)
    m = _resident(cfg, shape, hw, plan.notes)
    rows = plan.micro_batch_rows = _micro_batch(cfg, m, prompt_tokens, plan.notes, source)
    plan.seq_len = m.seq
    _sampler(cfg, m, hw, plan.notes)
    ckpt = cfg.gradient_checkpointing
    acts = rows * m.seq * shape.activation_bytes_per_token(ckpt, m.bf16)
    plan.terms = {"weights": m.weights, "gradients": m.gradients, "optimizer states (AdamW)": m.optimizer,
                  "sampler's weight copy": m.replica, "sampler's fused q/k/v, gate/up (hf)": m.fused,
                  "sampler's bf16 weights (hf)": m.cast, **({"checkpoint mmap (CPU)": m.mapped} if m.mapped else {}),
                  "ZeRO gradient bucket": m.bucket, "reference model": m.reference, "activations": acts,
                  "log-prob buffers, gathered layers": m.update_extra(rows, ckpt) - acts, "vLLM weights": m.engine,
                  "KV cache": m.kv_cache,
                  "activations (other setting)": rows * m.seq * shape.activation_bytes_per_token(not ckpt, m.bf16)}
    plan.phases = phase_peaks(m, rows, ckpt)
    for checkpointing in (ckpt, True) if not ckpt else (True,):
        name = "with checkpointing" if checkpointing else "without checkpointing"
        plan.max_micro_batch[name] = _largest_micro_batch(m, hw.memory - OVERHEAD[hw.kind], checkpointing)
    return plan


def _size(n: int) -> str:
    if n == 0:
        return f"{'-':>8}"
    return f"{n / GiB:8.2f} GiB" if n >= GiB / 10 else f"{n / MiB:8.1f} MiB"


def format_plan(plan: Plan, cfg) -> str:
    s, hw = plan.shape, plan.hw
    where = (f"{hw.ranks} GPU{'s' if hw.ranks > 1 else ''} x {hw.memory / GiB:.0f} GiB" if hw.kind == "gpu"
             else f"CPU, {hw.ranks} process{'es' if hw.ranks > 1 else ''}, {hw.memory * hw.ranks / GiB:.1f} GiB RAM")
    ckpt = "on" if cfg.gradient_checkpointing else "off"
    lines = [
        f"model: {s.n_params / 1e9:.3g}B parameters ({s.num_hidden_layers} layers, hidden {s.hidden_size}, "
        f"{s.num_attention_heads}/{s.num_key_value_heads} heads, vocab {s.vocab_size:,}) from {plan.shape_source}",
        f"run: {cfg.command}, distributed {cfg.distributed}, LoRA r={cfg.lora_r}, dtype "
        f"{getattr(cfg, 'dtype', 'float32')}, "
        f"rollout {getattr(cfg, 'rollout_backend', '-')}, micro-batch {plan.micro_batch_rows} x {plan.seq_len} tokens, "
        f"gradient checkpointing {ckpt}",
        f"hardware: {where}",
        "",
        "per rank:",
    ]
    other = "with" if not cfg.gradient_checkpointing else "without"
    for name, value in plan.terms.items():
        label = f"activations ({other} checkpointing)" if name == "activations (other setting)" else name
        lines.append(f"  {label:<38}{_size(value)}" + ("   (not in the total)" if name.endswith("setting)") else ""))
    lines.append("")
    lines.append("peak by phase:")
    for name, value in plan.phases.items():
        lines.append(f"  {name:<38}{_size(value)}")
    lines.append(f"  {'+ ' + ('CUDA context, allocator' if hw.kind == 'gpu' else 'interpreter and imports'):<38}"
                 f"{_size(OVERHEAD[hw.kind])}")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"total per rank: {plan.total / GiB:.2f} GiB of {hw.memory / GiB:.1f} GiB: {verdict}")
    for name, n in plan.max_micro_batch.items():
        lines.append(f"largest micro-batch that fits ({name}): {n} rows of {plan.seq_len} tokens")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def config_for_plan(trainers: dict, path, overrides: dict, method: str | None = None):
    """The config of ``path`` under the trainer it belongs to: ``method``, else the one whose steps
    key (``n_grpo_steps``, ``n_sft_steps``, ...) the file holds, else the first that accepts it."""
    if method is not None:
        if method not in trainers:
            raise ConfigError(f"--method: unknown {method!r}; expected one of {', '.join(trainers)}")
        return trainers[method][0].build(path, overrides)
    try:
        keys = set(load_yaml_file(path) or {})
    except (ConfigError, TypeError):  # the trainer's build below says what is wrong with the file
        keys = set()
    order = sorted(trainers, key=lambda name: trainers[name][0].steps_field not in keys)
    errors = []
    for name in order:
        try:
            return trainers[name][0].build(path, overrides)
        except ConfigError as exc:
            errors.append(str(exc))
    raise ConfigError(errors[0])
