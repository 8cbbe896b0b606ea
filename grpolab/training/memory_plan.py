"""``grpolab plan``: per-rank memory of a run, estimated from its config and the model's shape
(``config.json`` only: nothing is loaded or downloaded), and whether it fits.

What a rank holds is what grpolab's own code allocates (``run_model.py``, ``distributed.py``,
``core/logprobs.py``):

- the training weights in float32 (``dtype: bfloat16`` is autocast over fp32 weights), whole under
  none/DDP, ``1/world`` of them under FSDP2 and ZeRO-3; ZeRO-3 also keeps an fp32 master copy of its
  partition;
- gradients of the trainable parameters (fp32; sharded like the weights under FSDP2/ZeRO-2/3; DDP
  keeps a second copy in its all-reduce buckets) and AdamW's two fp32 moments (sharded by
  FSDP2/ZeRO, not by DDP); under LoRA only the adapters train;
- the sampler's plain copy of the full weights (``RunModel.replica``) whenever the training weights
  are sharded or adapted, and the hf sampler's fused q/k/v and gate/up weights (``fast_decoder``);
  ZeRO-3's gradient reduce bucket (``reduce_bucket_size``, whole on a GPU); and the frozen
  reference (``kl_coef``/``beta`` > 0; LoRA: none, the base with the adapter off);
- one micro-batch's activations (every tensor a decoder layer saves for its backward; with gradient
  checkpointing only each layer's input, plus one layer recomputed) and the log-prob buffers (the
  head runs ``LOGITS_CHUNK_BYTES`` of float32 logits at a time);
- the rollout: the hf backend's KV cache, or the colocated vLLM engine
  (``vllm_gpu_memory_utilization`` of the GPU: its weights, the rest KV cache; with sleep mode it is
  freed during the update); on a CPU its weights plus ``vllm_cpu_kvcache_space_gib``.

The peak is the largest of five phases: set-up (the whole model is loaded, and copied for the
sampler, before it is sharded), rollout, update (gradients and activations live), the optimizer
step (AdamW's foreach temporaries beside the gradients), and the weight sync after it (the full
weights gathered from the shards; merged W + BA under LoRA).
Validated against measured peak RSS of real CPU runs (tests/scale/test_memory_plan.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..core.logprobs import LOGITS_CHUNK_BYTES

GiB, MiB = 2**30, 2**20
# Shapes of named architectures, copied from their config.json (no hub access): `model` pointing at a
# directory that is not on this machine is matched by its last path component.
ARCHITECTURES: dict[str, dict] = {
    "Qwen2.5-Math-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                              max_position_embeddings=4096, tie_word_embeddings=True),
    "Qwen2.5-Math-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                            max_position_embeddings=4096, tie_word_embeddings=False),
}
# Beyond the modelled terms: a CUDA context with the allocator's slack (a typical figure, not measured
# here), or a CPU process that has imported torch and transformers (measured here: ~350 MB).
OVERHEAD = {"gpu": 1.0 * GiB, "cpu": 350 * MiB}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _targeted(targets) -> tuple[str, ...]:
    """The linear layers a ``lora_target_modules`` value names (``all-linear``: every one but the head)."""
    if targets == "all-linear":
        return LINEARS
    return tuple(t.split(".")[-1] for t in ([targets] if isinstance(targets, str) else targets))


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen2-style decoder, from its config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    head_dim: int

    @classmethod
    def from_config(cls, cfg: dict, source: str) -> "ModelShape":
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in keys if k not in cfg]
        if missing:
            raise ValueError(f"{source}: no {', '.join(missing)} (grpolab plan reads decoder-only config.json files)")
        heads = int(cfg["num_attention_heads"])
        return cls(hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
                   num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
                   num_key_value_heads=int(cfg.get("num_key_value_heads") or heads), vocab_size=int(cfg["vocab_size"]),
                   max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
                   head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads))

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def n_params(self) -> int:
        bias = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        layer = sum(a * b for a, b in self.linears().values()) + bias + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + self.hidden_size

    def lora_params(self, r: int, targets) -> int:
        """Adapter parameters (A: r x in, B: out x r) on the targeted linear layers of every layer."""
        per_layer = sum(r * (a + b) for n, (a, b) in self.linears().items() if n in _targeted(targets))
        return self.num_hidden_layers * per_layer

    def lora_weight_fraction(self, targets) -> float:
        """Share of the weights the adapters cover (merged into a new tensor at each sync)."""
        covered = self.num_hidden_layers * sum(a * b for n, (a, b) in self.linears().items() if n in _targeted(targets))
        return covered / self.n_params

    def activation_bytes_per_token(self, checkpointing: bool, autocast_bf16: bool) -> int:
        """What the backward keeps per token, all layers. A decoder layer saves: its two RMSNorms'
        input, normalised and scaled outputs in fp32 (6H); q and k before and after RoPE, the
        rotate-half terms, v and the attention output (4 q_dim + 4 kv_dim); the MLP's gate, up,
        SiLU(gate) and their product (4 I); under bf16 autocast the matmuls' outputs are bf16 and
        each linear keeps its own bf16 copy of its input (5H). With checkpointing a layer keeps only
        its fp32 input, and one layer at a time is recomputed whole."""
        a = 2 if autocast_bf16 else 4
        h = self.hidden_size
        layer = 6 * h * 4 + (4 * self.q_dim + 4 * self.kv_dim + 4 * self.intermediate_size) * a
        if autocast_bf16:
            layer += 5 * h * a
        head = 3 * h * 4  # the final norm
        if checkpointing:
            return self.num_hidden_layers * h * 4 + layer + head
        return self.num_hidden_layers * layer + head

    def fused_sampler_bytes(self) -> int:
        """The hf backend's lean decoder (``rollout/fast_decoder.py``) keeps fused fp32 copies of each
        layer's q/k/v and gate/up weights."""
        bias = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        per_layer = (
            self.hidden_size * (self.q_dim + 2 * self.kv_dim) + bias + 2 * self.hidden_size * self.intermediate_size
        )
        return 4 * self.num_hidden_layers * per_layer

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.kv_dim * element_bytes


def tiny_shape(name: str) -> ModelShape:
    from ..models.tiny import CHARACTERS, SPECIAL_TOKENS, TAG_TOKENS, TINY_SIZES

    if name not in TINY_SIZES:
        raise ValueError(f"model: unknown embedded model {name!r}; expected one of {', '.join(TINY_SIZES)}")
    return ModelShape.from_config(dict(TINY_SIZES[name], vocab_size=len(SPECIAL_TOKENS + TAG_TOKENS + CHARACTERS),
                                       max_position_embeddings=512, tie_word_embeddings=True), f"embedded:{name}")


def model_shape(model: str, architecture: str | None = None) -> tuple[ModelShape, str]:
    """(shape, where it came from): a named architecture, ``embedded:NAME``, a local directory's
    config.json, or — for a directory not on this machine — the architecture its name matches."""
    presets = {k.lower(): k for k in ARCHITECTURES}
    if architecture is not None:
        if architecture.lower() not in presets:
            raise ValueError(f"--architecture: unknown {architecture!r}; known: {', '.join(ARCHITECTURES)}")
        name = presets[architecture.lower()]
        return ModelShape.from_config(ARCHITECTURES[name], name), f"architecture {name} (its config.json values)"
    if model.startswith("embedded:"):
        return tiny_shape(model.split(":", 1)[1]), model
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        try:
            cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path / 'config.json'}: invalid JSON ({exc.msg})") from None
        return ModelShape.from_config(cfg, str(path / "config.json")), f"{path / 'config.json'}"
    if path.name.lower() in presets:
        name = presets[path.name.lower()]
        return (ModelShape.from_config(ARCHITECTURES[name], name),
                f"architecture {name} ({model} is not on this machine; its config.json values)")
    raise ValueError(f"model: {model} has no config.json here and matches no known architecture "
                     f"({', '.join(ARCHITECTURES)}); give a local model directory or --architecture NAME")


@dataclass
class Hardware:
    kind: str  # gpu | cpu
    ranks: int
    memory: int  # bytes per rank (a GPU's, or the machine's shared by its processes)

    @classmethod
    def detect(cls, gpus: int | None, gpu_memory_gib: float | None, nproc: int | None) -> "Hardware":
        if gpus is not None or gpu_memory_gib is not None:
            if not gpus or gpus < 1:
                raise ValueError("--gpus: give the number of GPUs (>= 1) with --gpu-memory")
            if not gpu_memory_gib or gpu_memory_gib <= 0:
                raise ValueError("--gpu-memory: give each GPU's memory in GiB (e.g. 80)")
            return cls("gpu", gpus, int(gpu_memory_gib * GiB))
        ranks = nproc or 1
        total = 0
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
        return cls("cpu", ranks, total // ranks)


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


def _zero_options(cfg) -> dict:
    """The ``zero_optimization`` block of the run's DeepSpeed config (grpolab's default: ZeRO-3)."""
    if cfg.distributed != "deepspeed":
        return {"stage": 0}
    if not cfg.deepspeed_config:
        return {"stage": 3}
    path = Path(cfg.deepspeed_config)
    try:
        return json.loads(path.read_text()).get("zero_optimization", {})
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"deepspeed_config: cannot read {path} ({exc})") from None


def longest_prompt(cfg, n: int = 256) -> int | None:
    """Tokens of the longest of the first ``n`` training prompts, rendered as the run renders them;
    None where the data or the tokenizer is not on this machine."""
    from ..data import DataError, TemplateError
    from ..models import load_tokenizer
    from .inputs import load_inputs

    try:
        if cfg.model.startswith("embedded:"):
            from ..models.tiny import build_char_tokenizer

            tokenizer = build_char_tokenizer()
        else:
            tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code)
        inputs = load_inputs(cfg, tokenizer)
        questions = [getattr(e, "question", None) or getattr(e, "prompt", "") for e in inputs.train[:n]]
        return max(len(tokenizer(inputs.template.format(q))["input_ids"]) for q in questions)
    except (DataError, TemplateError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def estimate(cfg, hw: Hardware, architecture: str | None = None, prompt_tokens: int | None = None) -> Plan:
    """The memory plan of ``cfg`` (any trainer's config) on ``hw``."""
    shape, source = model_shape(cfg.model, architecture)
    plan = Plan(shape, source, hw)
    world = hw.ranks if cfg.distributed != "none" else 1
    if cfg.distributed == "none" and hw.ranks > 1:
        plan.notes.append(f"distributed is none: one process uses one of the {hw.ranks} devices")
    zero = _zero_options(cfg)
    stage = int(zero.get("stage", 0))
    sharded_params = cfg.distributed == "fsdp2" or stage == 3
    sharded_state = sharded_params or stage == 2
    P = shape.n_params
    lora = cfg.lora_r > 0
    trainable = shape.lora_params(cfg.lora_r, cfg.lora_target_modules) if lora else P
    gpu = hw.kind == "gpu"
    bf16 = getattr(cfg, "dtype", "float32") == "bfloat16"  # autocast: bf16 matmuls over fp32 weights
    offload = cfg.fsdp_cpu_offload and gpu
    share = world if sharded_params else 1
    state_share = world if sharded_state else 1

    # --- persistent: weights, the sampler's copy, the reference, optimizer states
    weights = 4 * P // share
    if stage == 3:
        weights += 4 * trainable // world  # ZeRO-3's fp32 master partition beside the parameters'
    vllm = getattr(cfg, "rollout_backend", "hf") == "vllm"
    # a plain full copy of the weights when the trained ones are sharded or adapted: the hf sampler's,
    # and with vLLM still kept for validation and final/ (the engine's weights stream from the shards)
    replica = 4 * P if (lora or sharded_params) else 0
    kl = getattr(cfg, "kl_coef", 0) > 0 or cfg.command == "dpo"
    reference = 4 * P if kl and not lora else 0
    optimizer = 8 * trainable // state_share
    grads = 4 * trainable // state_share
    if cfg.distributed == "ddp" and world > 1:
        grads *= 2  # DDP's all-reduce buckets hold a second copy of every gradient
    bucket = 0
    if stage == 3 and zero.get("contiguous_gradients", True):
        # ZeRO-3's gradient reduce bucket, torch.empty(reduce_bucket_size): a GPU allocates it whole, a
        # CPU only the pages the gradients fill
        size = int(float(zero.get("reduce_bucket_size", 5e8)))
        bucket = 4 * (size if gpu else min(size, trainable))
    step_temp = 4 * trainable // state_share  # torch's AdamW (foreach): one temporary per state tensor
    if offload:  # FSDP2 CPU offload: shards, their gradients and AdamW live in host memory
        plan.notes.append("fsdp_cpu_offload: the weight shards, gradients and optimizer states are in host memory")
        weights = grads = optimizer = step_temp = 0

    # --- one micro-batch's sequences
    sampled = hasattr(cfg, "sampling_max_tokens")
    new_tokens = getattr(cfg, "sampling_max_tokens", 0)
    if prompt_tokens is None:
        prompt_tokens = longest_prompt(cfg)
    if prompt_tokens is None:
        max_len = getattr(cfg, "vllm_max_model_len", None)
        prompt_tokens = max_len - new_tokens if max_len and max_len > new_tokens else 512
        plan.notes.append(f"prompts taken as {prompt_tokens} tokens: the data or tokenizer is not on this machine "
                          "(--prompt-tokens to change)")
    else:
        plan.notes.append(f"longest prompt: {prompt_tokens} tokens (--prompt-tokens to change)")
    plan.seq_len = seq = min(prompt_tokens + new_tokens, shape.max_position_embeddings)
    rows_per_rank = math.ceil(cfg.train_batch_size / world)
    rows = math.ceil(rows_per_rank / max(1, getattr(cfg, "gradient_accumulation_steps", 1)))
    if cfg.command == "dpo":
        rows *= 2  # chosen and rejected
    plan.micro_batch_rows = rows

    def update_extra(n_rows: int, checkpointing: bool) -> int:
        """What an update adds on top of the persistent state for micro-batches of ``n_rows``."""
        tokens = n_rows * seq
        acts = tokens * shape.activation_bytes_per_token(checkpointing, bf16)
        chunk = min(tokens, max(1, LOGITS_CHUNK_BYTES // (4 * shape.vocab_size)))
        logits = 3 * chunk * shape.vocab_size * 4  # logits, log-softmax, softmax for the entropy (float32)
        gathered = 0
        if sharded_params and world > 1:  # one layer whole at a time (and the next one prefetched)
            layer = (P - shape.vocab_size * shape.hidden_size) // shape.num_hidden_layers
            gathered = 2 * 4 * layer
        return acts + logits + gathered

    # --- the rollout
    engine = kv_cache = fused = 0
    if vllm:
        vdtype = cfg.vllm_dtype if cfg.vllm_dtype != "auto" else getattr(cfg, "dtype", "float32")
        vbytes = 2 if vdtype in ("bfloat16", "float16") else 4
        engine = vbytes * P // cfg.vllm_tensor_parallel_size
        if gpu:
            kv_cache = max(0, int(cfg.vllm_gpu_memory_utilization * hw.memory) - engine)
        else:
            kv_cache = cfg.vllm_cpu_kvcache_space_gib * GiB
        per_token = shape.kv_bytes_per_token(vbytes) // cfg.vllm_tensor_parallel_size
        plan.notes.append(f"vLLM KV cache: {kv_cache // max(1, per_token):,} tokens "
                          f"({kv_cache // max(1, per_token * seq)} sequences of {seq})")
    elif sampled:
        fused = shape.fused_sampler_bytes()
        batch = min(getattr(cfg, "rollout_max_batch_size", 256),
                    math.ceil(getattr(cfg, "rollout_batch_size", getattr(cfg, "train_batch_size", 1)) / world))
        kv_cache = batch * seq * shape.kv_bytes_per_token(2 if bf16 else 4) + batch * shape.vocab_size * 4
    asleep = vllm and gpu and cfg.vllm_enable_sleep_mode  # level 1: weights offloaded, KV cache freed

    tokens = rows * seq
    acts = tokens * shape.activation_bytes_per_token(cfg.gradient_checkpointing, bf16)
    plan.terms = {
        "weights": weights,
        "gradients": grads,
        "optimizer states (AdamW)": optimizer,
        "sampler's weight copy": replica,
        "sampler's fused q/k/v, gate/up (hf)": fused,
        "ZeRO-3 gradient bucket": bucket,
        "reference model": reference,
        "activations": acts,
        "log-prob buffers, gathered layers": update_extra(rows, cfg.gradient_checkpointing) - acts,
        "vLLM weights": engine,
        "KV cache": kv_cache,
        "activations (other setting)": tokens * shape.activation_bytes_per_token(not cfg.gradient_checkpointing, bf16),
    }

    persistent = weights + replica + fused + bucket + reference + optimizer + (grads if stage else 0)
    resident_engine = 0 if asleep else engine + (kv_cache if vllm else 0)
    setup_peak = 4 * P + replica + reference  # the whole model, loaded (and copied) before any sharding
    sync = 0
    if sharded_params and world > 1 and not vllm:
        sync = 4 * P * (2 if stage == 3 else 1)  # gathered full weights (ZeRO-3 clones them too)
    elif sharded_params and world > 1:
        sync = 4 * (P - shape.vocab_size * shape.hidden_size) // shape.num_hidden_layers  # one layer at a time
    if lora and not vllm:
        sync += int(4 * P * shape.lora_weight_fraction(cfg.lora_target_modules))  # merged W + BA, beside them

    def phases(n_rows: int, checkpointing: bool) -> dict[str, int]:
        return {
            "set-up": setup_peak,  # before the vLLM engine is built
            "rollout": persistent + (engine + kv_cache if vllm else kv_cache + fused),  # fused: rebuilt beside the old
            "update": persistent + grads * (0 if stage else 1) + update_extra(n_rows, checkpointing) + resident_engine,
            "optimizer step": persistent + grads * (0 if stage else 1) + step_temp + resident_engine,
            # the engine is awake to take the new weights (its KV cache still freed under sleep mode)
            "weight sync": persistent + sync + (engine + (0 if asleep else kv_cache) if vllm else 0),
        }

    plan.phases = phases(rows, cfg.gradient_checkpointing)
    budget = hw.memory - OVERHEAD[hw.kind]
    for ckpt in (cfg.gradient_checkpointing, True):
        best, n = 0, 1
        while n <= 1 << 16 and max(phases(n, ckpt).values()) <= budget:
            best, n = n, n * 2
        lo, hi = best, min(n, 1 << 16)
        while best and hi - lo > 1:  # binary search between the last power of two that fits and the next
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if max(phases(mid, ckpt).values()) <= budget else (lo, mid)
        plan.max_micro_batch["with checkpointing" if ckpt else "without checkpointing"] = lo if best else 0
        if cfg.gradient_checkpointing:
            break
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
    import yaml

    from .config import ConfigError

    if method is not None:
        if method not in trainers:
            raise ConfigError(f"--method: unknown {method!r}; expected one of {', '.join(trainers)}")
        return trainers[method][0].build(path, overrides)
    try:
        keys = set(yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {})
    except (OSError, yaml.YAMLError, TypeError, ValueError):
        keys = set()
    order = sorted(trainers, key=lambda name: trainers[name][0].steps_field not in keys)
    errors = []
    for name in order:
        try:
            return trainers[name][0].build(path, overrides)
        except ConfigError as exc:
            errors.append(str(exc))
    raise ConfigError(errors[0])
