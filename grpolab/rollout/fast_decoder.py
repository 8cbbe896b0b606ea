"""A lean inference path for Llama/Qwen2-architecture models: the same weights and the same math
as the Hugging Face forward, without its per-call overhead (module dispatch, mask builders, cache
objects). On small models that overhead is most of a decode step; here a step is a few dozen
tensor ops. It keeps a preallocated KV cache and supports dropping finished rows. Grouped-query
attention (fewer key/value heads than query heads) reads the cache in place: expanding the key/value
heads per layer and token copied the whole cache each step (3x slower decoding on SmolLM2-135M).
With ``models.precision.set_logits_fp32`` the output head runs in float32 under autocast, as the
trainer's does.

Used only for sampling (no autograd); ``supports(model)`` lists what it covers, and the rollout
backend falls back to the Hugging Face forward otherwise. The tests check that its logits match
the Hugging Face forward.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..models import precision

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def supports(model) -> bool:
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        return False
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "mlp_bias", False):
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "layers") and hasattr(inner, "rotary_emb")


class _Layer:
    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1_w, self.ln1_eps = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2_w, self.ln2_eps = (layer.post_attention_layernorm.weight,
                                    layer.post_attention_layernorm.variance_epsilon)
        # q, k and v in one matmul
        self.qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0)
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        self.qkv_b = torch.cat(biases, 0) if all(b is not None for b in biases) else None
        self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        self.gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)
        self.down_w = mlp.down_proj.weight
        self.scaling = attn.scaling

    MATMUL = ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "down_w")

    def cast_into(self, buffer: torch.Tensor, offset: int) -> tuple[_Layer, int]:
        """This layer with its matmul weights and biases in ``buffer``'s dtype, written into ``buffer``
        from ``offset`` on: what autocast casts them to at every call (the same values), cast once
        instead of at every decode step; a weight already in that dtype (a bf16 LoRA run's merged
        layers) is used as it is, not copied. Returns the layer and the next free offset."""
        out = copy.copy(self)
        for name in self.MATMUL:
            weight = getattr(self, name)
            if weight is not None and weight.dtype != buffer.dtype:
                view = buffer[offset : offset + weight.numel()].view(weight.shape)
                view.copy_(weight)
                setattr(out, name, view)
                offset += weight.numel()
        return out, offset


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Attention of q (B, nq, L, hd) over a cache of nkv <= nq key/value heads (grouped-query
    attention, query head h reading key/value head h // (nq / nkv), as Hugging Face's ``repeat_kv``)
    without copying the cache. One new token per row (decoding): the group's query heads become the
    query positions of their key/value head, (B, nkv, group, hd), one plain attention call; several
    (prefill, once per prompt): SDPA's ``enable_gqa``."""
    b, nq, length, hd = q.shape
    nkv = keys.shape[1]
    if nkv == nq:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=scale)
    if length == 1:
        grouped = q.reshape(b, nkv, nq // nkv, hd)  # attn_mask (B, 1, 1, S) broadcasts over the group
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=attn_mask, scale=scale)
        return out.reshape(b, nq, 1, hd)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=scale, enable_gqa=True)


def _compute_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype the matmuls compute in: autocast's where it is on for ``device_type`` (on the CPU too:
    ``torch.is_autocast_enabled()`` without a device reads CUDA's), else ``dtype``."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


class FastDecoder:
    """Prefill and step with a preallocated KV cache. Weights are snapshotted at construction (call
    ``refresh()`` after the weights change; the rollout backend does this per ``generate``)."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        inner = self.model.model
        self.embed = inner.embed_tokens.weight
        self.norm_w, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = self.model.lm_head.weight
        self.logits_fp32 = precision.logits_fp32_enabled(self.model)
        self.lm_head_fp32 = self.lm_head.float() if self.logits_fp32 else None
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.rope_scale = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.layers = [_Layer(layer) for layer in inner.layers]
        self._cast: dict[torch.dtype, tuple[list[_Layer], torch.Tensor]] = {}

    def _weights(self, dtype: torch.dtype) -> tuple[list[_Layer], torch.Tensor]:
        """The layers and the head's weight as the matmuls compute them: under autocast to another
        dtype (bf16 over float32 weights), copies cast at the first step after ``refresh`` or ``release``
        (once per ``generate``) instead of autocast casting every weight at every step (540 MB read, 270 MB written per
        SmolLM2 decode step); the values are autocast's own casts, so the logits are unchanged."""
        if dtype == self.embed.dtype:
            return self.layers, self.lm_head
        if dtype not in self._cast:  # one block for all of them: freed whole, it leaves the heap no holes
            weights = [getattr(lay, n) for lay in self.layers for n in _Layer.MATMUL]
            head_size = 0 if self.logits_fp32 else self.lm_head.numel()  # an fp32 head runs lm_head_fp32
            size = sum(w.numel() for w in weights if w is not None and w.dtype != dtype) + head_size
            buffer = torch.empty(size, dtype=dtype, device=self.lm_head.device)
            layers, offset = [], 0
            for lay in self.layers:
                cast, offset = lay.cast_into(buffer, offset)
                layers.append(cast)
            head = self.lm_head if self.logits_fp32 else buffer[offset:].view(self.lm_head.shape).copy_(self.lm_head)
            self._cast[dtype] = (layers, head)
        return self._cast[dtype]

    def release(self) -> None:
        """Drop the KV cache and the cast weights (the backend calls it when a ``generate`` ends, so
        that the update does not hold them)."""
        self._cast.clear()
        self.k_cache, self.v_cache = [], []

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attn_mask: torch.Tensor, start: int) -> torch.Tensor:
        """ids/positions (B, L); attn_mask (B, 1, L, start+L) bool; writes K/V at [start, start+L)."""
        b, length = ids.shape
        x = F.embedding(ids, self.embed)
        dtype = _compute_dtype(x.dtype, x.device.type)
        cos, sin = self._rope(positions, x.dtype)  # as Hugging Face's rotary: the hidden states' dtype
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        nq, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        end = start + length
        layers, lm_head = self._weights(dtype)
        for i, lay in enumerate(layers):
            h = _rms(x, lay.ln1_w, lay.ln1_eps)
            qkv = F.linear(h, lay.qkv_w, lay.qkv_b)
            q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(b, length, nq, hd).transpose(1, 2)
            k = k.view(b, length, nkv, hd).transpose(1, 2)
            v = v.view(b, length, nkv, hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k_cache[i][:, :, start:end] = k
            self.v_cache[i][:, :, start:end] = v
            # the cache is in the matmuls' dtype, which autocast's attention casts q, k and v to anyway
            out = _attention(q.to(dtype), self.k_cache[i][:, :, :end], self.v_cache[i][:, :, :end], attn_mask,
                             lay.scaling)
            out = out.transpose(1, 2).reshape(b, length, nq * hd)
            x = x + F.linear(out, lay.o_w, lay.o_b)
            h = _rms(x, lay.ln2_w, lay.ln2_eps)
            gate, up = F.linear(h, lay.gate_up_w).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lay.down_w)
        x = _rms(x[:, -1:], self.norm_w, self.norm_eps)
        if self.logits_fp32:  # models.precision.set_logits_fp32: the head in float32, outside autocast
            with torch.autocast(device_type=x.device.type, enabled=False):
                return F.linear(x.float(), self.lm_head_fp32)[:, -1]
        return F.linear(x, lm_head)[:, -1].float()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, max_new: int) -> torch.Tensor:
        """Left-padded prompts ``ids``/``mask`` (B, L) -> last-position logits (B, V)."""
        b, length = ids.shape
        device = ids.device
        dtype = _compute_dtype(self.embed.dtype, device.type)
        total = length + max_new
        self.k_cache = [
            torch.zeros(b, self.n_kv, total, self.head_dim, dtype=dtype, device=device) for _ in self.layers
        ]
        self.v_cache = [
            torch.zeros(b, self.n_kv, total, self.head_dim, dtype=dtype, device=device) for _ in self.layers
        ]
        self.key_mask = torch.zeros(b, total, dtype=torch.bool, device=device)
        self.key_mask[:, :length] = mask.bool()
        self.length = length
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        self.next_pos = positions[:, -1] + 1
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        attn = causal[None] & mask.bool()[:, None, :]
        # padding queries attend to themselves: finite garbage that no real token ever reads
        attn = attn | torch.eye(length, dtype=torch.bool, device=device)[None]
        return self._forward(ids, positions, attn[:, None], 0)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row -> next logits (B, V)."""
        pos = self.length
        self.key_mask[:, pos] = True
        attn = self.key_mask[:, None, None, : pos + 1]
        logits = self._forward(tokens.unsqueeze(-1), self.next_pos.unsqueeze(-1), attn, pos)
        self.length += 1
        self.next_pos = self.next_pos + 1
        return logits

    def select(self, keep: torch.Tensor) -> None:
        """Keep only these rows (finished rows leave the cache)."""
        self.k_cache = [c.index_select(0, keep) for c in self.k_cache]
        self.v_cache = [c.index_select(0, keep) for c in self.v_cache]
        self.key_mask = self.key_mask.index_select(0, keep)
        self.next_pos = self.next_pos.index_select(0, keep)

    def repeat(self, n: int) -> None:
        """Each row becomes ``n`` consecutive rows (a group shares one prefill)."""
        self.k_cache = [c.repeat_interleave(n, 0) for c in self.k_cache]
        self.v_cache = [c.repeat_interleave(n, 0) for c in self.v_cache]
        self.key_mask = self.key_mask.repeat_interleave(n, 0)
        self.next_pos = self.next_pos.repeat_interleave(n, 0)
