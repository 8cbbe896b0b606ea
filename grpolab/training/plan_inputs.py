"""What a memory plan (``memory_plan.py``) is about besides the run's config, read without loading the
model: its shape — a Llama/Qwen2-style decoder's sizes from its ``config.json`` (or a
named architecture's, or the embedded model's), and what each of its parts costs in bytes — the
hardware (GPUs as given, or this machine), and the length of the run's longest prompt."""

from __future__ import annotations

import json
from dataclasses import dataclass
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
