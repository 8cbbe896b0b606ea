"""LoRA through ``peft`` (Hu et al. 2021): low-rank adapters on the linear layers, the base frozen.

Three things a trainer needs beyond ``get_peft_model``:

- the **reference policy** of GRPO/PPO/DPO is the base model, i.e. the same module with the
  adapter disabled (``AdapterDisabled``): no second copy of the weights;
- the **sampler** draws from the merged weights W + (alpha / r) B A (``merged_state_dict``),
  computed from a state dict so it works the same on a plain, DDP or FSDP2-gathered model and never
  touches the training weights (peft's in-place merge/unmerge would round them);
- **checkpoints** store the base weights as an ordinary model directory plus the adapter
  (``base_state_dict``, ``adapter_state_dict``), so a resumed run rebuilds the same adapter.
"""

from __future__ import annotations

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"


def require_peft():
    try:
        import peft
    except ImportError:  # pragma: no cover - the message is the point
        raise ImportError("lora_r > 0 needs peft: pip install -e '.[scale]' (or pip install peft)") from None
    return peft


def apply_lora(model, r: int, alpha: float, dropout: float = 0.0, target_modules="all-linear"):
    """``model`` with LoRA adapters of rank ``r`` on ``target_modules`` (peft's names, or
    ``all-linear``: every linear layer but the output head); only the adapters train. The adapters
    are initialised as peft does (B = 0), so the wrapped model starts equal to the base."""
    peft = require_peft()
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if getattr(model.config, "tie_word_embeddings", False) and any(t.split(".")[-1] == "lm_head" for t in targets):
        # a merged lm_head would be copied into the tied input embeddings too: a different policy
        raise ValueError("lora_target_modules: 'lm_head' is tied to the input embeddings in this model; "
                         "adapt the other linear layers (all-linear leaves the head out)")
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                             bias="none", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def base_reference(model: str) -> str:
    """How an adapter names its base (``base_model_name_or_path``): an embedded name as is, a
    directory as an absolute path, so the adapter loads from any working directory."""
    from pathlib import Path

    return model if model.startswith("embedded:") else str(Path(model).expanduser().resolve())


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def lora_scaling(model) -> float:
    cfg = model.peft_config[ADAPTER]
    return cfg.lora_alpha / (cfg.r ** 0.5 if getattr(cfg, "use_rslora", False) else cfg.r)


class AdapterDisabled(torch.nn.Module):
    """The reference policy: calls the LoRA model inside ``disable_adapter()``, i.e. the frozen
    base. It owns no parameters (its state dict is empty: nothing is copied or checkpointed)."""

    def __init__(self, policy):
        super().__init__()
        object.__setattr__(self, "_policy", policy)  # not a submodule: no second registration

    def forward(self, *args, **kwargs):
        with self._policy.disable_adapter():
            return self._policy(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._policy.parameters(recurse)

    @property
    def config(self):
        return self._policy.config

    def state_dict(self, *args, **kwargs):
        return {}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return None


def _plain_key(key: str) -> str:
    return key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key


def base_state_dict(state: dict) -> dict:
    """The base model's weights (ordinary Hugging Face names) from a peft model's state dict."""
    return {_plain_key(k).replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}


def adapter_state_dict(state: dict) -> dict:
    """Only the adapter weights, under the peft model's own names."""
    return {k: v for k, v in state.items() if ".lora_" in k}


def merged_state_dict(state: dict, scaling: float) -> dict:
    """W + scaling * B @ A for every adapted linear layer (ordinary names): the weights the policy
    computes with, as one plain model (what the sampler and a merged export use)."""
    return dict(merged_weights(state.items(), scaling))


def merged_weights(items, scaling: float):
    """``merged_state_dict`` as a stream: (ordinary name, weight) pairs from a peft model's
    (name, tensor) pairs in state-dict order, each adapted layer's W + scaling * B @ A yielded as soon
    as its W, A and B have passed (one layer held at a time: what a weight sync streams)."""
    pending: dict[str, dict] = {}  # stem -> {"w"|"a"|"b": tensor} until the layer is whole
    for key, value in items:
        for part, suffix in (("w", ".base_layer.weight"), ("a", f".lora_A.{ADAPTER}.weight"),
                             ("b", f".lora_B.{ADAPTER}.weight")):
            if key.endswith(suffix):
                stem = key[: -len(suffix)]
                layer = pending.setdefault(stem, {})
                layer[part] = value
                if len(layer) == 3:
                    del pending[stem]
                    w = layer["w"]  # fp32, or bf16 (a bf16 run's frozen base): merged in fp32, rounded once
                    merged = (w.float() + scaling * (layer["b"].float() @ layer["a"].float())).to(w.dtype)
                    del w, layer, value  # a stream holds one layer: nothing of this one outlives its yield
                    yield _plain_key(f"{stem}.weight"), merged
                    del merged
                break
        else:
            if ".lora_" not in key:
                yield _plain_key(key).replace(".base_layer.", "."), value
    if pending:
        raise ValueError(f"LoRA layer {next(iter(pending))} lacks its base weight or an adapter matrix")


def adapted_layers(model) -> dict[str, torch.nn.Module]:
    """The peft model's adapted layers by their plain model's module name (``model.layers.0.mlp.up_proj``)."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A") and ADAPTER in module.lora_A:
            out[_plain_key(name)] = module
    return out


def sampler_shell(model):
    """A plain copy of ``model`` (before ``apply_lora``) that holds no weights of its own: every
    parameter and buffer is the model's own object (a frozen LoRA base never changes). ``own_merged``
    then gives its adapted layers tensors of their own for W + BA; the rest stay shared."""
    import copy

    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared).eval()


def own_merged(shell, policy, dtype: torch.dtype | None) -> set[str]:
    """Give the shell's copy of each adapted layer a weight of its own (for the merged W + BA, filled by
    ``refresh``), and store the policy's frozen base of those layers in ``dtype`` (bf16 in a bf16 run:
    what autocast computes with anyway, so the policy's outputs are unchanged; None: as loaded). Layer
    by layer, so the old fp32 tensor is freed before the next is made. Returns the shell's weight names
    that are its own."""
    own = set()
    for name, module in adapted_layers(policy).items():
        base = module.base_layer
        target = shell.get_submodule(name)
        keep = dtype or base.weight.dtype
        target.weight = torch.nn.Parameter(torch.empty_like(base.weight, dtype=keep), requires_grad=False)
        if dtype is not None and base.weight.dtype != dtype:
            base.weight = torch.nn.Parameter(base.weight.detach().to(dtype), requires_grad=False)
            for layer in (base, target):  # a forward outside autocast (an entropy probe) runs too
                layer.register_forward_hook(outside_autocast)
                layer.register_forward_pre_hook(input_in_weight_dtype)
        own.add(f"{name}.weight")
    return own


def _autocast_on(x: torch.Tensor) -> bool:
    return torch.is_autocast_enabled(x.device.type)


def input_in_weight_dtype(module, args):
    """Forward pre-hook of a linear layer stored in bf16, outside autocast only (autocast casts the input
    itself, so nothing changes there): the input cast to bf16; ``outside_autocast`` casts the output
    back to the input's dtype. Module-level functions: a pickled model keeps them."""
    x = args[0]
    if _autocast_on(x) or x.dtype == module.weight.dtype:
        return None
    module._input_dtype = x.dtype
    return (x.to(module.weight.dtype), *args[1:])


def outside_autocast(module, args, output):
    """Forward hook paired with ``input_in_weight_dtype``: the output in the input's dtype (fp32)."""
    dtype = module.__dict__.pop("_input_dtype", None)
    return output.to(dtype) if dtype is not None else None
