"""What a memory plan (``memory_plan.py``) is about besides the run's config, read without loading the
model: its shape — a Llama/Qwen2-style decoder's sizes from its ``config.json`` (or a
named architecture's, or the embedded model's), and what each of its parts costs in bytes — the
hardware (GPUs as given, or this machine), the length of the run's longest prompt, and the ZeRO
block of its DeepSpeed config. Each is checked as it is read: one line naming the flag, or the file
and its key, for a size that is not a positive integer, a count below 1, a memory that is not a
finite figure, a size beyond 2**40, a boolean that is not true or false, or a prompt that does
not fit the context."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..data import DataError, TemplateError
from ..models import load_tokenizer
from ..models.tiny import CHARACTERS, SPECIAL_TOKENS, TAG_TOKENS, TINY_SIZES, build_char_tokenizer
from .inputs import load_inputs

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
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
REQUIRED_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
MAX_SIZE = 2**40  # beyond it a size is a typo: no tensor dimension, layer or vocabulary count is so large
MAX_GPU_MEMORY_GIB = 2**20  # 1 PiB: beyond it a figure is a typo (or inf), not a GPU


def _positive_int(cfg: dict, key: str, source: str, default: int | None = None) -> int:
    """``cfg[key]`` as a size: a positive integer (JSON's ``1e3``, ``32.7``, ``Infinity``, ``NaN``,
    strings and booleans are not); ``default`` where the key is absent or null (optional keys)."""
    value = cfg.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key} must be a positive integer, got {_shown(value)}")
    if value > MAX_SIZE:
        shown = str(value) if value < 10**30 else f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
        raise ValueError(f"{source}: {key} must be at most 2**40 ({MAX_SIZE:,}), got {shown}")
    return value


def _shown(value) -> str:
    """A config.json value as its JSON text (a scalar) or its type's name (a list, a mapping)."""
    return json.dumps(value) if isinstance(value, (int, float, str)) or value is None else type(value).__name__


def _flag(cfg: dict, key: str, source: str, default: bool) -> bool:
    """``cfg[key]`` as a JSON boolean (``true``/``false``; transformers' config refuses ``"yes"``, 1,
    null), ``default`` where the key is absent."""
    if key not in cfg:
        return default
    value = cfg[key]
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be true or false, got {_shown(value)}")
    return value


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
    checkpoint_fp32: bool = True  # loaded from a float32 safetensors file (config.json's dtype float32, or none given)

    @classmethod
    def from_config(cls, cfg: dict, source: str) -> "ModelShape":
        """The shape of a config.json's values; each size a positive integer (one line naming the key
        and ``source`` otherwise: no negative, zero, fractional, infinite or missing size)."""
        if not isinstance(cfg, dict):
            raise ValueError(f"{source}: not a JSON object but {type(cfg).__name__} (grpolab plan reads decoder-only "
                             "config.json files)")
        missing = [k for k in REQUIRED_SIZES if k not in cfg]
        if missing:
            raise ValueError(f"{source}: no {', '.join(missing)} (grpolab plan reads decoder-only config.json files)")
        size = {k: _positive_int(cfg, k, source) for k in REQUIRED_SIZES}
        heads = size["num_attention_heads"]
        kv_heads = _positive_int(cfg, "num_key_value_heads", source, default=heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
        head_dim = _positive_int(cfg, "head_dim", source, default=size["hidden_size"] // heads)
        if head_dim < 1:
            raise ValueError(f"{source}: hidden_size {size['hidden_size']} over {heads} attention heads leaves no "
                             "head dimension (give head_dim)")
        return cls(**size, num_key_value_heads=kv_heads,
                   max_position_embeddings=_positive_int(cfg, "max_position_embeddings", source, default=2048),
                   tie_word_embeddings=_flag(cfg, "tie_word_embeddings", source, False),
                   attention_bias=_flag(cfg, "attention_bias", source, cfg.get("model_type") == "qwen2"),
                   head_dim=head_dim,
                   checkpoint_fp32=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32") == "float32")

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
    def matmul_params_per_layer(self) -> int:
        """One decoder layer's linear weights and their biases (q/k/v biases where ``attention_bias``)."""
        bias = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        return sum(a * b for a, b in self.linears().values()) + bias

    @property
    def n_params(self) -> int:
        layer = self.matmul_params_per_layer + 2 * self.hidden_size
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

    def cast_sampler_bytes(self, head: bool = True) -> int:
        """Under bf16 autocast over fp32 weights, the hf backend's lean decoder casts every matmul weight
        (each layer's linears, and the head unless ``logits_fp32`` keeps it fp32) to bf16 once per
        ``generate`` and frees them after it."""
        head_params = self.vocab_size * self.hidden_size if head else 0
        return 2 * (self.num_hidden_layers * self.matmul_params_per_layer + head_params)

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.kv_dim * element_bytes


def tiny_shape(name: str) -> ModelShape:
    if name not in TINY_SIZES:
        raise ValueError(f"model: unknown embedded model {name!r}; expected one of {', '.join(TINY_SIZES)}")
    shape = ModelShape.from_config(dict(TINY_SIZES[name], vocab_size=len(SPECIAL_TOKENS + TAG_TOKENS + CHARACTERS),
                                        max_position_embeddings=512, tie_word_embeddings=True), f"embedded:{name}")
    return replace(shape, checkpoint_fp32=False)  # built in memory: no file mapped


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
        except UnicodeDecodeError:
            raise ValueError(f"{path / 'config.json'}: not a text file (a config.json is UTF-8 JSON)") from None
        except ValueError as exc:  # an integer past Python's int-from-str limit (4300 digits)
            raise ValueError(f"{path / 'config.json'}: invalid JSON ({exc})") from None
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
        """``--gpus`` GPUs of ``--gpu-memory`` GiB each, else this machine's memory shared by ``--nproc``
        processes; a count below 1, or a memory that is not a finite figure above 0, is one line."""
        if gpus is not None or gpu_memory_gib is not None:
            if not gpus or gpus < 1:
                raise ValueError("--gpus: give the number of GPUs (>= 1) with --gpu-memory")
            if not gpu_memory_gib or not 0 < gpu_memory_gib <= MAX_GPU_MEMORY_GIB:  # nan fails both comparisons
                got = "" if gpu_memory_gib is None else f", got {gpu_memory_gib}"
                raise ValueError(f"--gpu-memory: give each GPU's memory in GiB, above 0 and at most "
                                 f"{MAX_GPU_MEMORY_GIB:,} (e.g. 80){got}")
            return cls("gpu", gpus, int(gpu_memory_gib * GiB))
        if nproc is not None and nproc < 1:
            raise ValueError(f"--nproc: give the number of processes (>= 1), got {nproc}")
        ranks = nproc or 1
        total = 0
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
        return cls("cpu", ranks, total // ranks)


def longest_prompt(cfg, n: int = 256) -> int | None:
    """Tokens of the longest of the first ``n`` training prompts, rendered as the run renders them;
    None where the data or the tokenizer is not on this machine."""
    try:
        if cfg.model.startswith("embedded:"):
            tokenizer = build_char_tokenizer()
        else:
            tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code)
        inputs = load_inputs(cfg, tokenizer)
        questions = [getattr(e, "question", None) or getattr(e, "prompt", "") for e in inputs.train[:n]]
        return max(len(tokenizer(inputs.template.format(q))["input_ids"]) for q in questions)
    except (DataError, TemplateError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def check_prompt_tokens(prompt_tokens: int, new_tokens: int, context: int, source: str) -> None:
    """``--prompt-tokens``: at least 1, and short enough that the model's context has room for a new
    token after it (one line naming the flag otherwise; a prompt that fits but leaves less than
    ``sampling_max_tokens`` is the plan's note)."""
    if prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens: give the longest prompt's length in tokens (>= 1), got {prompt_tokens}")
    room = context - (1 if new_tokens else 0)
    if prompt_tokens > room:
        raise ValueError(f"--prompt-tokens: {prompt_tokens} tokens leave no room for a response in the model's "
                         f"context of {context} tokens (max_position_embeddings from {source}); the run would "
                         "refuse such a prompt")


def zero_options(cfg) -> dict:
    """The ``zero_optimization`` block of the run's DeepSpeed config (grpolab's default: ZeRO-3),
    with its ``stage`` (0-3) checked."""
    if cfg.distributed != "deepspeed":
        return {"stage": 0}
    if not cfg.deepspeed_config:
        return {"stage": 3}
    path = Path(cfg.deepspeed_config)
    try:
        zero = json.loads(path.read_text()).get("zero_optimization", {})
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"deepspeed_config: cannot read {path} ({exc})") from None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"deepspeed_config: {path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return {**zero, "stage": stage}


def zero_bucket(zero: dict, trainable: int, gpu: bool) -> int:
    """ZeRO's gradient reduce bucket with ``contiguous_gradients`` (DeepSpeed's default):
    ``torch.empty(reduce_bucket_size)`` of fp32 gradients, two with ZeRO-1/2's ``overlap_comm`` (off
    by default there) — a GPU allocates it whole, a CPU only the pages the gradients fill."""
    if not zero["stage"] or not zero.get("contiguous_gradients", True):
        return 0
    try:
        size = int(float(zero.get("reduce_bucket_size", 5e8)))
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"deepspeed_config: zero_optimization.reduce_bucket_size must be a number of elements, "
                         f"got {zero.get('reduce_bucket_size')!r}") from None
    buffers = 2 if zero["stage"] < 3 and zero.get("overlap_comm") else 1
    return 4 * buffers * (size if gpu else min(size, trainable))
