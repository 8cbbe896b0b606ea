"""``RunModel``: the run's model under its engine and LoRA — the half of ``Run`` that changes with
``distributed`` and ``lora_r``, so that ``Run`` and the trainers read the same on 1 or N processes.

It holds three views of one set of weights:

- ``model``: what trainers train — the plain module (one process, DDP: gradients are reduced at the
  optimizer step), the FSDP2-sharded module, or the DeepSpeed engine (built when the trainer's
  optimizer is tracked, since DeepSpeed wraps the optimizer too);
- ``sampling_model``: what the rollout backend and evaluation call — the training module itself
  when its weights are whole and unadapted, else a plain copy with the full weights (gathered under
  FSDP2/ZeRO-3; merged W + BA under LoRA), refreshed after each outer step that changed them;
- the saved forms: checkpoints (model directory of the full — with LoRA, base — weights written by
  rank 0, the adapter in the trainer state, the optimizer state sharded per rank under FSDP2 and
  DeepSpeed) and ``final/`` (an ordinary Hugging Face directory; with LoRA the adapter, and the
  merged model on request).
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import torch

from ..models import lora
from ..models.compiled import CompiledLayers, compile_refusal
from ..rollout.base import WeightSyncError, probe_ids, probe_tolerance
from . import distributed, sharded_optimizer
from .checkpoints import atomic_directory, save_final
from .config import ConfigError
from .optimization import StepResult, optimizer_step


def enable_gradient_checkpointing(model) -> None:
    """Activations recomputed in the backward (non-reentrant: works with frozen LoRA bases and FSDP2)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    try:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:  # transformers 4.x
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


class RunModel:
    def __init__(self, cfg, model, device, state: dict | None):
        self.cfg, self.device = cfg, device
        self.dist = distributed.current()
        self.optimizer_name, self.optimizer = None, None
        if cfg.gradient_checkpointing and not getattr(model, "is_activation_checkpointing", False):
            enable_gradient_checkpointing(model)
        self.lora = cfg.lora_r > 0
        # LoRA on whole weights: the sampler's copy shares the frozen base and owns only its merged
        # layers, stored (like the policy's frozen base) in the run's compute dtype; sharded: a full copy
        self.own_merged: set[str] | None = None
        shell = self.lora and not self.dist.sharded
        if shell:
            self.replica = lora.sampler_shell(model).requires_grad_(False)
        else:
            copy_weights = self.lora or self.dist.sharded
            self.replica = copy.deepcopy(model).eval().requires_grad_(False) if copy_weights else None
        if self.lora:
            model = lora.apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
            if state is not None and "lora_adapter" in state:
                model.load_state_dict(state["lora_adapter"], strict=False)
            if shell:
                base_dtype = torch.bfloat16 if getattr(cfg, "dtype", "float32") == "bfloat16" else None
                self.own_merged = lora.own_merged(self.replica, model, base_dtype)
        self.compiled = compiled_layers(cfg, model, device)
        self.model = distributed.wrap(model, device).train()
        self.dist.replica = self.replica
        # a vLLM engine holds its own copy, streamed after each update (``sync``): the plain copy is
        # refreshed only where it is read (validation's samples, final/), not after every step
        # (a vLLM server; with max_staleness >= 1, a sampler process) holds its own copy too
        self.engine_holds_weights = getattr(cfg, "rollout_backend", "hf") in ("vllm", "vllm_server") \
            or getattr(cfg, "max_staleness", 0) > 0
        self.stale = True
        self.refresh()

    def forward_context(self, autocast):
        """The context of the trainers' forwards (``Run.autocast``): ``autocast`` (bf16 where asked), and
        the compiled decoder layers where ``compile`` is on (``models.compiled``)."""
        if self.compiled is None:
            return autocast
        compiled = self.compiled

        @contextlib.contextmanager
        def both():
            with autocast(), compiled():
                yield
        return both

    @property
    def sampling_model(self):
        return self.replica if self.replica is not None else self.model

    def _full(self) -> dict:
        return distributed.full_state_dict(self.model)

    def refresh(self) -> None:
        """Copy the current weights into the sampler's copy (a collective under sharding: every
        rank calls it at the same point, after the outer step)."""
        if self.replica is None or not self.stale:
            return
        full = self._full()
        if self.own_merged is not None:  # one merged layer at a time into the shell's own tensors
            mine = dict(self.replica.named_parameters())
            with torch.no_grad():
                for name, value in lora.merged_weights(full.items(), lora.lora_scaling(self._peft())):
                    if name in self.own_merged:
                        mine[name].copy_(value)
            self.stale = False
            return
        if self.lora:
            full = lora.merged_state_dict(full, lora.lora_scaling(self._peft()))
        self.replica.load_state_dict({k: v.to(self.device) for k, v in full.items()}, strict=False)
        self.stale = False

    def _peft(self):
        return getattr(self.model, "module", self.model)

    def sync(self, backend, step: int | None = None) -> None:
        """Give the rollout backend the updated weights (every rank, after the outer step): an
        engine with its own copy (vLLM) loads ``full_weights`` as they stream, then the sync canary
        checks that they arrived (``check_sync``); the HF backend samples from ``sampling_model``
        itself (refreshed first)."""
        if self.engine_holds_weights:
            backend.sync_weights(self.sampling_model, weights=self.full_weights())
            self.check_sync(backend, step)
        else:
            self.refresh()
            backend.sync_weights(self.sampling_model)

    def check_sync(self, backend, step: int | None = None) -> None:
        """The sync canary for an engine that cannot hand its weights back (vLLM packs them for its
        kernels): its log-probs of a fixed probe sequence against this model's float32 forward, mean
        |difference| within ``probe_tolerance`` of the engine's dtype, else ``WeightSyncError`` naming
        the step (``check_weight_sync: false`` skips it). A collective forward under sharding."""
        probe = getattr(backend, "probe_log_probs", None)
        if probe is None or not getattr(self.cfg, "check_weight_sync", True):
            return
        ids, mine = self.probe()
        check_probe(mine, probe(ids), backend.weights_dtype, f"step {step}" if step is not None else "a weight sync")

    def probe(self) -> tuple[list[int], torch.Tensor]:
        """The canary's probe ids and this model's float32 log-probs of ``ids[1:]`` after their
        prefixes (eval mode, no gradients): what an engine holding the same weights must give back."""
        ids = probe_ids(self._peft().get_input_embeddings().num_embeddings)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor([ids], device=self.device)).logits[0, :-1].float()
        finally:
            self.model.train(was_training)
        mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:], device=logits.device)[:, None])[:, 0]
        return ids, mine.cpu()

    def full_weights(self):
        """The sampler's weights as a stream of (ordinary name, tensor) — full, and with LoRA merged —
        gathered one parameter (a LoRA layer: its W, A, B) at a time: what a rollout engine with its
        own copy loads after an update (a collective under sharding: every rank reads it to the end).
        ``gathered_peak_bytes`` is then the most bytes the stream had made and not yet seen freed at
        once (0 when nothing is gathered or merged: one process, DDP)."""
        import weakref

        alive: list = []  # weak references to the tensors this stream made (gathered or merged)
        self.gathered_peak_bytes = 0
        local = {_storage(v) for v in self._peft().state_dict(keep_vars=True).values()}
        items = distributed.full_weights(self.model)
        if self.lora:
            items = lora.merged_weights(items, lora.lora_scaling(self._peft()))
        for name, value in items:
            if _storage(value) not in local:
                alive.append((weakref.ref(value), value.numel() * value.element_size()))
            alive = [(ref, size) for ref, size in alive if ref() is not None]
            self.gathered_peak_bytes = max(self.gathered_peak_bytes, sum(size for _, size in alive))
            yield name, value
            del value

    # ------------------------------------------------------------ optimizer

    def attach_optimizer(self, name: str, optimizer, resumed_from: Path | None) -> None:
        """A sharded engine's optimizer: DeepSpeed builds its engine around it now; its state is
        saved and restored per rank (``save_sharded``), not in ``trainer_state.pt``."""
        self.optimizer_name, self.optimizer = name, optimizer
        if self.dist.strategy == "deepspeed":
            self.model = distributed.wrap_optimizer(self.model, optimizer, self.cfg.max_grad_norm)
        if resumed_from is not None:
            sharded_optimizer.load_sharded_optimizer(self.model, optimizer, resumed_from)

    def optimizer_step(self, parameters_of, optimizer, scheduler, loss) -> StepResult:
        self.stale = True
        if self.dist.strategy == "deepspeed":
            norm = distributed.deepspeed_step(loss)
            if norm is None or not math.isfinite(norm):
                return StepResult(float("nan") if norm is None else norm, True)
            if scheduler is not None:
                scheduler.step()
            return StepResult(norm)
        distributed.sync_gradients()
        return optimizer_step(parameters_of or self.model, optimizer, scheduler, self.cfg.max_grad_norm, loss)

    # ------------------------------------------------------------ saving

    def for_checkpoint(self) -> tuple[torch.nn.Module, dict | None, dict]:
        """(module whose config is saved, its weights or None for the module's own, extra trainer
        state): with LoRA the base weights go to the model files and the adapter to the state."""
        if self.replica is None:
            return self.model, None, {}
        full = {k: v.detach().cpu() for k, v in self._full().items()}
        if not self.lora:
            return self.replica, full, {}
        return self.replica, lora.base_state_dict(full), {"lora_adapter": lora.adapter_state_dict(full)}

    def save_sharded(self, directory: Path) -> None:
        if self.optimizer is not None:
            sharded_optimizer.save_sharded_optimizer(self.model, self.optimizer, directory)

    def save_final(self, tokenizer, target: Path, extra=None) -> Path:
        """``final/``: an ordinary Hugging Face directory written by rank 0. With LoRA: the adapter
        (``adapter_config.json`` + weights), and with ``lora_save_merged`` the merged model instead,
        its adapter in ``final/adapter/``."""
        if self.replica is None:
            return save_final(self.model, tokenizer, target, extra) if self.dist.is_main else target
        full = {k: v.detach().cpu() for k, v in self._full().items()}  # every rank: a collective

        def write(tmp: Path) -> None:
            if self.lora:
                adapter_dir = tmp / "adapter" if self.cfg.lora_save_merged else tmp
                # the base is the run's model, not the checkpoint a resumed run happened to load from
                self._peft().peft_config[lora.ADAPTER].base_model_name_or_path = lora.base_reference(self.cfg.model)
                self._peft().save_pretrained(adapter_dir, state_dict=lora.adapter_state_dict(full))
                tokenizer.save_pretrained(adapter_dir)
            if self.cfg.lora_save_merged or not self.lora:
                self.replica.save_pretrained(tmp, safe_serialization=True)  # refreshed: full or merged weights
                tokenizer.save_pretrained(tmp)
            if extra is not None:
                extra(tmp)

        return atomic_directory(target, write) if self.dist.is_main else target


def compiled_layers(cfg, model, device) -> CompiledLayers | None:
    """The decoder layers compiled for the update (``compile``): ``true`` compiles or stops the run with one
    line saying why it cannot; ``auto`` compiles on a CUDA device where nothing refuses and the update shares no
    prompts (a compiled GRPO update runs each row whole: on the CPU sharing saved more than compiling, and the
    compile costs ~6 short steps: docs/results/compile.md); ``false`` runs eager."""
    setting = getattr(cfg, "compile", "false")
    if setting == "false":
        return None
    if setting == "auto" and (torch.device(device).type != "cuda" or getattr(cfg, "share_prompt_prefix", False)):
        return None
    why = compile_refusal(model, gradient_checkpointing=cfg.gradient_checkpointing,
                          engine=getattr(cfg, "distributed", "none"))
    if why is None:
        return CompiledLayers(model)
    if setting == "auto":
        return None
    raise ConfigError(f"compile: true, but {why}; set compile: false (or auto)")


def check_probe(mine, theirs, dtype, where: str | None = None) -> None:
    """The sync canary's verdict: the trainer's probe log-probs ``mine`` against an engine's ``theirs``,
    mean |difference| within ``probe_tolerance(dtype)``, else ``WeightSyncError`` (led by ``where``)."""
    gap = float((torch.as_tensor(mine).cpu() - torch.tensor(theirs)).abs().mean())
    tol = probe_tolerance(dtype)
    if not gap <= tol:  # NaN included
        raise WeightSyncError(f"{where + ': ' if where else ''}sync canary: the rollout engine's log-probs of a probe "
                              f"sequence differ from the trainer's by {gap:.3g} nats/token (tolerance {tol:.3g} for "
                              f"{str(dtype).removeprefix('torch.')} weights): the weights did not arrive")


def _storage(t) -> int:
    """The address of a tensor's storage (a DTensor's: its local shard's)."""
    local = getattr(t, "to_local", None)
    return (local() if local is not None else t).untyped_storage().data_ptr()


def frozen_copy(model):
    """A frozen reference policy: a copy of the starting model, eval mode, no gradients. With LoRA,
    the same model with its adapter disabled (the base: no second copy of the weights); under
    FSDP2/ZeRO-3, a plain copy of the full weights (its forwards need no other rank)."""
    if lora.is_lora(model):
        return lora.AdapterDisabled(model)
    replica = distributed.current().replica
    if replica is not None:
        return copy.deepcopy(replica).eval().requires_grad_(False)
    return copy.deepcopy(model).eval().requires_grad_(False)


def check_distributed(cfg, dist) -> None:
    """Batch sizes must split evenly over the ranks, and some trainers cannot run under an engine yet."""
    world = dist.world_size
    if world == 1:
        return
    if cfg.trains_value_head:
        # the engine wraps the policy before the method adds its critic: the value head's gradients would
        # never be averaged (each rank's critic would drift apart) and GAE whitening would see one rank
        raise ConfigError(f"distributed: {cfg.distributed}: {cfg.command}'s value head is trained outside the "
                          "engine's wrapping (its gradients would not be averaged over ranks); use distributed: none")
    group = getattr(cfg, "group_size", 1) if cfg.groups_on_one_rank else 1
    rollout = getattr(cfg, "rollout_batch_size", None)
    if cfg.groups_on_one_rank and rollout % (group * world):
        raise ConfigError(f"rollout_batch_size ({rollout}) must be divisible by group_size x processes "
                          f"({group} x {world}): each group stays on one rank")
    per_rank = getattr(cfg, "train_batch_size", world)
    accumulation = 1 if cfg.uneven_micro_batches else getattr(cfg, "gradient_accumulation_steps", 1)
    if per_rank % (world * accumulation):
        raise ConfigError(f"train_batch_size ({per_rank}) must be divisible by processes x gradient_accumulation_steps "
                          f"({world} x {accumulation})")
