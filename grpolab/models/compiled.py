"""Compiled decoder layers (the ``compile`` field): ``torch.compile`` (inductor) of a causal LM's
repeated transformer block, used by the trainer's forwards only (``CompiledLayers``).

Regional compilation: one compiled function of the block class's ``forward`` serves every layer
(the layer is an argument and its parameters are graph inputs, dynamo's ``inline_inbuilt_nn_modules``),
so the compile costs one block's, not the whole model's, and with ``dynamic=True`` the row count and
the sequence length are symbolic: a new length runs the same graph. What is compiled once each: the
forward with gradients (and its backward, through AOTAutograd) and the forward without (the old and
reference log-probs), per autocast dtype; a batch of one row is specialised once more (dynamo's 0/1
specialisation). ``graphs_compiled`` reads dynamo's counter of them.

The output head (``fused_head``'s chunked head: a Python loop over chunks with its own backward),
the embedding, the rotary table and the mask stay eager: the head is a matmul at the machine's
floor already; what compiling buys is the fusion of the block's element-wise work (RMSNorm, rotary,
SiLU gating, residual adds) and fewer passes over its activations in the backward.

The layers' forwards are swapped only inside the context, so sampling (the HF backend's
``generate``, the lean decoder) and deep copies (the sampler's replica) see the eager modules; a
reference policy's copy joins the context through ``adopt`` (``Run.track`` adopts every tracked
module). Inside it the models' ``config.use_cache`` is off (a training forward needs no KV cache); a
call that passes a cache runs the eager block, so a compiled model's GRPO update runs each row whole
rather than its prompt once per group (``shared_prefix.supports_shared_prefix`` is False for it: the
cached forward would run eager). ``calls`` counts the forwards that took the compiled path.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator

import torch

# a decoding forward's KV cache, as transformers names it (``cache`` from 5.x, ``past_key_values`` before)
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")
# the layer forwards that took the compiled path in this process, by (grad mode, whether the layer's weights train):
# ("grad", "trained") the policy's update, ("no_grad", "trained") its old log-probs, ("no_grad", "frozen") a reference
calls: collections.Counter = collections.Counter()


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks: the longest ``nn.ModuleList`` whose entries are all of
    one class (``model.layers`` of a Llama/Qwen model), found through peft/DDP wrappers; [] if none."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best) \
                and len({type(m) for m in module}) == 1:
            best = list(module)
    return best


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (its ``unique_graphs`` counter): each new
    length that recompiled would add one."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cpu_build_refusal(model: Any) -> str | None:
    """Why inductor cannot build CPU kernels for ``model`` here, or None: with torch's vector kernels
    off (``ATEN_CPU_CAPABILITY=default``) inductor still emits vectorised C++ for the CPU it detects,
    which does not compile (``at::vec`` undeclared)."""
    params = next(iter(model.parameters()), None)
    on_cpu = params is None or params.device.type == "cpu"
    if on_cpu and torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "NO AVX"):
        return "torch runs without CPU vector kernels here (ATEN_CPU_CAPABILITY=default): inductor cannot build"
    return None


def compile_refusal(model: Any, *, gradient_checkpointing: bool = False, engine: str = "none") -> str | None:
    """Why ``CompiledLayers`` cannot serve ``model`` (one line), or None when it can."""
    layers = decoder_layers(model)
    if not layers:
        return f"{type(model).__name__} has no list of repeated decoder layers to compile"
    if any("forward" in layer.__dict__ for layer in layers):
        return "its decoder layers already carry an instance forward (another wrapper)"
    if (why := cpu_build_refusal(model)) is not None:
        return why
    if gradient_checkpointing:
        return "gradient_checkpointing is on (the checkpoint would wrap the compiled block)"
    if engine not in ("none", "ddp"):
        return f"distributed: {engine} wraps each layer in its own engine (sharded parameters)"
    return None


class CompiledLayers:
    """``with compiled():`` runs ``model``'s decoder layers through one ``torch.compile``d forward
    (``dynamic=True``); outside the context the model is untouched. Re-entrant."""

    def __init__(self, model: Any, *, dynamic: bool = True, backend: str = "inductor"):
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"compile: {type(model).__name__} has no list of repeated decoder layers")
        self.eager = type(layers[0]).forward
        self.compiled = torch.compile(self.eager, dynamic=dynamic, backend=backend)
        self.layers: list[torch.nn.Module] = []
        self.forwards: list[Any] = []
        self.configs: list[Any] = []
        self.depth = 0
        self.adopt(model)
        # the compiled block runs no KV cache: GRPO's shared-prompt forward (models.shared_prefix) steps aside
        model.grpolab_compiled = True

    def adopt(self, model: Any) -> int:
        """Add another model's layers of the same class (a reference policy's copy) to the context: they run
        through the same compiled function (their parameters are its inputs). Returns how many were added."""
        if self.depth:
            raise RuntimeError("CompiledLayers.adopt inside the compiled context")
        known = {id(layer) for layer in self.layers}
        kind = type(self.layers[0]) if self.layers else None
        new = [layer for layer in decoder_layers(model)
               if (kind is None or type(layer) is kind) and id(layer) not in known]
        if not new:
            return 0
        eager, compiled = self.eager, self.compiled

        def bind(layer: torch.nn.Module):
            def forward(*args, **kwargs):
                if kwargs.get("use_cache") or any(kwargs.get(k) is not None for k in CACHE_ARGUMENTS):
                    return eager(layer, *args, **kwargs)
                calls["grad" if torch.is_grad_enabled() else "no_grad",
                      "trained" if next(layer.parameters()).requires_grad else "frozen"] += 1
                return compiled(layer, *args, **kwargs)
            return forward

        self.layers += new
        self.forwards += [bind(layer) for layer in new]
        seen = {id(c) for c in self.configs}
        for c in (getattr(m, "config", None) for m in model.modules()):
            if c is not None and hasattr(c, "use_cache") and id(c) not in seen:
                seen.add(id(c))
                self.configs.append(c)
        return len(new)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.depth += 1
        if self.depth == 1:
            self.use_cache = [c.use_cache for c in self.configs]
            for c in self.configs:
                c.use_cache = False
            for layer, forward in zip(self.layers, self.forwards):
                layer.forward = forward
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                for layer in self.layers:
                    del layer.forward
                for c, value in zip(self.configs, self.use_cache):
                    c.use_cache = value
