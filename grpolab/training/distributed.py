"""Data-parallel and sharded training: the process group, the engines, and the few collectives a
trainer's figures need. Distribution is a property of the run, not of the algorithm: ``Run`` sets it
up from the config (``distributed: none | ddp | fsdp2 | deepspeed``) and the environment ``torchrun``
leaves (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``); trainers stay the same.

The engines are the existing ones, never a home-made parallel layer:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel``. Micro-batches run on the plain module
  (DDP's reducer is not armed, so gradients accumulate locally, exactly as under ``no_sync``); at
  the optimizer step one zero-loss forward/backward through the DDP wrapper makes DDP all-reduce
  the accumulated ``.grad`` — the documented ``no_sync`` contract, with any number of micro-batches
  per rank.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root (optionally
  ``CPUOffloadPolicy``). Every forward all-gathers and every backward reduce-scatters, so ranks run
  the same number of forward/backward passes: ``padding_micro_batches`` pads a rank that has fewer
  live micro-batches with zero-loss ones.
- ``deepspeed``: ``deepspeed.initialize`` with a ZeRO-2/3 JSON, ``managed_gradient_accumulation``
  off (backward accumulates locally; ``engine.step()`` reduces and updates), forwards through the
  engine (ZeRO-3 all-gathers per forward: balanced as for FSDP2).

Every engine averages gradients over ranks; the loss normalisers are therefore the global counts
divided by the world size (``grad_normaliser``), which makes one optimizer step's gradient equal
the single-process gradient on the same rows (tested to 1e-6). The optimizer state the sharded
engines keep per rank is saved, checked and read back by ``sharded_optimizer.py``.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

STRATEGIES = ("none", "ddp", "fsdp2", "deepspeed")
DEFAULT_DEEPSPEED = {"zero_optimization": {"stage": 3}}


class DistributedError(ValueError):
    """A distributed set-up that cannot work; one line naming the field."""


@dataclass
class Dist:
    """This process's place in the run. ``engine`` is the DDP wrapper or the DeepSpeed engine."""

    strategy: str = "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False
    engine: Any = None
    deepspeed_config: dict = field(default_factory=dict)
    fsdp_cpu_offload: bool = False

    @property
    def enabled(self) -> bool:
        return self.strategy != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Parameters or gradients live in pieces: forwards/backwards are collectives."""
        return self.strategy in ("fsdp2", "deepspeed")


_CURRENT = Dist()
_ENV_BEFORE: dict[str, str | None] = {}  # the torchrun variables setup() replaced for a group of one


def current() -> Dist:
    """The running process's ``Dist`` (one process: strategy ``none``, rank 0 of 1)."""
    return _CURRENT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(strategy: str, device: torch.device, *, deepspeed_config: str | None = None,
          fsdp_cpu_offload: bool = False) -> Dist:
    """Join (or, for a single process asking for an engine, create) the process group.
    ``none`` costs nothing: no process group, no collectives."""
    global _CURRENT
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy == "none":
        if world > 1:
            raise DistributedError(f"distributed: none, but torchrun started {world} processes; set distributed: "
                                   "ddp | fsdp2 | deepspeed (e.g. --distributed ddp)")
        _CURRENT = Dist()
        return _CURRENT
    ds = _deepspeed_config(deepspeed_config) if strategy == "deepspeed" else {}
    owns = not tdist.is_initialized()
    if owns and "RANK" not in os.environ:  # one process with an engine (tests, debugging): a group of one
        single = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        _ENV_BEFORE.update({k: os.environ.get(k) for k in single})  # put back by teardown: no stale port later
        os.environ.update(single)
    if owns:
        try:
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        except BaseException:
            _restore_env()
            raise
    _CURRENT = Dist(strategy, tdist.get_rank(), tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owns,
                    deepspeed_config=ds, fsdp_cpu_offload=fsdp_cpu_offload)
    return _CURRENT


def teardown(barrier: bool = True) -> None:
    """Leave the process group if this run created it; back to one process. ``barrier``: wait for
    every rank first (a normal end); False when this rank is failing, perhaps alone."""
    global _CURRENT
    if _CURRENT.owns_group and tdist.is_initialized():
        if barrier:
            tdist.barrier()
        tdist.destroy_process_group()
        _restore_env()
    _CURRENT = Dist()


def _restore_env() -> None:
    """The torchrun variables as they were before ``setup`` made a group of one."""
    for key, value in _ENV_BEFORE.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _ENV_BEFORE.clear()


def _deepspeed_config(path: str | None) -> dict:
    if path is None:
        return json.loads(json.dumps(DEFAULT_DEEPSPEED))
    p = Path(path)
    if not p.is_file():
        raise DistributedError(f"deepspeed_config {path}: no such file")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DistributedError(f"deepspeed_config {path}:{exc.lineno}: invalid JSON ({exc.msg})") from None


def device_for(device: torch.device) -> torch.device:
    """Each rank on its own GPU (``LOCAL_RANK``); CPUs are shared."""
    d = current()
    if d.enabled and device.type == "cuda":
        torch.cuda.set_device(d.local_rank)
        return torch.device("cuda", d.local_rank)
    return device


# ---------------------------------------------------------------- collectives for figures


def barrier() -> None:
    if current().enabled:
        tdist.barrier()


def all_reduce(value, op: str = "sum"):
    """Sum (or max/min) of a float, int or tensor over ranks; the value itself in one process."""
    if not current().enabled or current().world_size == 1:
        return value
    t = (value.detach().clone().double()
         if isinstance(value, torch.Tensor)
         else torch.tensor(float(value), dtype=torch.float64))
    device = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
    t = t.to("cuda" if device.type == "cuda" else "cpu")
    tdist.all_reduce(t, op={"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}[op])
    if isinstance(value, torch.Tensor):
        return t.to(device=value.device, dtype=value.dtype)
    return int(t.item()) if isinstance(value, int) and not isinstance(value, bool) else float(t.item())


def grad_normaliser(local_count, minimum=None):
    """The loss denominator that makes engine-averaged gradients equal the single-process ones:
    the global count (sequences or tokens of the optimizer batch over all ranks, at least
    ``minimum``) / world size. One process: the count itself (at least ``minimum``)."""
    d = current()
    total = local_count if not d.enabled else all_reduce(local_count.double() if isinstance(local_count, torch.Tensor)
                                                         else local_count)
    if minimum is not None:
        total = total.clamp(min=minimum) if isinstance(total, torch.Tensor) else max(total, minimum)
    return total if not d.enabled else total / d.world_size


def all_gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order."""
    if not current().enabled or current().world_size == 1:
        return [obj]
    out = [None] * current().world_size
    tdist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not current().enabled or current().world_size == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def mean_metrics(record: dict, weight: float = 1.0) -> dict:
    """Numbers averaged over ranks (weighted by ``weight``, e.g. each rank's example count), those
    named ``*_max`` the largest; other values from rank 0. Step keys are equal on every rank, so
    they pass through unchanged."""
    if not current().enabled or current().world_size == 1:
        return record
    gathered = all_gather_objects((record, float(weight)))
    out = dict(gathered[0][0])
    for key, value in out.items():
        if (isinstance(value, (int, float))
            and not isinstance(value, bool)
            and not key.endswith("_step")
            and key != "epoch"):
            pairs = [(r[key], w) for r, w in gathered if isinstance(r.get(key), (int, float))]
            total = sum(w for _, w in pairs) or 1.0
            out[key] = max(v for v, _ in pairs) if key.endswith("_max") else sum(v * w for v, w in pairs) / total
    return out


def shard(items: list, rank: int | None = None, world: int | None = None) -> list:
    """This rank's contiguous share of ``items`` (whole groups stay together when ``len(items)``
    is a multiple of the world size; otherwise the first ranks get one more)."""
    d = current()
    rank, world = d.rank if rank is None else rank, d.world_size if world is None else world
    size, extra = divmod(len(items), world)
    start = rank * size + min(rank, extra)
    return items[start : start + size + (rank < extra)]


# ---------------------------------------------------------------- engines


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Put ``model`` under the run's engine (DeepSpeed waits for the optimizer: ``wrap_optimizer``).
    Returns the module trainers call."""
    d = current()
    if d.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        d.engine = DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    elif d.strategy == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        options = {"offload_policy": CPUOffloadPolicy()} if d.fsdp_cpu_offload else {}
        for layer in decoder_layers(model):
            fully_shard(layer, **options)
        fully_shard(model, **options)
    return model


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks (the units FSDP2 shards one at a time): ``model.model.layers`` for
    Llama/Qwen2 (through a peft wrapper too), else every ``ModuleList``'s children."""
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and m[0].__class__.__name__.endswith("DecoderLayer"):
            return list(m)
    return [c for m in model.modules() if isinstance(m, torch.nn.ModuleList) for c in m]


def wrap_optimizer(model, optimizer, max_grad_norm: float | None):
    """DeepSpeed only: build the engine around ``model`` and the trainer's own optimizer (ZeRO
    wraps it; the trainer's LR scheduler keeps driving its param groups). Returns the engine."""
    d = current()
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed

    config = dict(d.deepspeed_config)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=d.world_size,
                  managed_gradient_accumulation=False, gradient_clipping=float(max_grad_norm or 0.0),
                  steps_per_print=2**31 - 1, wall_clock_breakdown=False)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    d.engine = engine
    return engine


def deepspeed_stage() -> int:
    return int(current().deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def dummy_backward(model) -> None:
    """A forward/backward whose loss is exactly zero: keeps ranks in step (every parameter takes
    part, so each engine's hooks fire) without changing any gradient."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    logits = out.logits if hasattr(out, "logits") else out[0]
    (logits.float().sum() * 0.0).backward()


def padding_micro_batches(n_local: int) -> int:
    """Sharded engines: how many zero-loss micro-batches (``dummy_backward``) this rank runs after
    its ``n_local`` real ones so every rank runs as many as the busiest, and every all-gather and
    reduce-scatter has all ranks present. A collective: call it on every rank *before* the
    micro-batches (collectives must come in the same order on every rank)."""
    d = current()
    if not d.sharded or d.world_size == 1:
        return 0
    # the step needs a backward on every rank even when no row of the batch contributes: DeepSpeed's
    # engine.step() does, and FSDP2 leaves the root's parameters unsharded (plain tensors) after a
    # no-grad forward (old log-probs) until a backward reshards them
    return max(int(all_reduce(n_local, "max")), 1) - n_local


def sync_gradients() -> None:
    """Before the optimizer step: DDP all-reduces the locally accumulated gradients (one zero-loss
    pass through the wrapper; see the module doc). FSDP2 reduced them in each backward; DeepSpeed
    reduces them in ``engine.step()``."""
    d = current()
    if d.strategy == "ddp" and d.world_size > 1:
        dummy_backward(d.engine)


# ---------------------------------------------------------------- full weights, DeepSpeed's step


def full_state_dict(model) -> dict:
    """Every parameter and buffer whole, on every rank (a collective under FSDP2 and ZeRO-3): what
    the sampler, the reference copy and the saved model directories are built from."""
    d = current()
    if d.strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if d.strategy == "deepspeed" and deepspeed_stage() == 3:
        import deepspeed

        module = getattr(model, "module", model)
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    module = getattr(model, "module", model)
    return {k: v.detach() for k, v in module.state_dict().items()}


def full_weights(model):
    """``full_state_dict`` as a stream of (name, whole tensor), one tensor gathered at a time (a
    collective under FSDP2 and ZeRO-3: every rank iterates to the end in the same order): what a
    weight sync sends to a rollout engine without holding more than one parameter beyond the shard.
    FSDP2: ``DTensor.full_tensor()`` per entry; ZeRO-3: ``GatheredParameters`` per parameter (a
    copy leaves the context, since the gathered storage is released at its exit); else the
    module's own tensors (nothing copied)."""
    d = current()
    module = getattr(model, "module", model) if d.strategy == "deepspeed" else model
    zero3 = d.strategy == "deepspeed" and deepspeed_stage() == 3
    if zero3:
        import deepspeed
    from torch.distributed.tensor import DTensor

    for name, value in module.state_dict(keep_vars=True).items():
        if zero3 and hasattr(value, "ds_id"):
            with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
                value = value.detach().clone()
        elif isinstance(value, DTensor):
            value = value.detach().full_tensor()
        yield name, value.detach()


def deepspeed_step(loss: float | None):
    """DeepSpeed's optimizer step (reduce, clip to ``gradient_clipping``, update). Returns the
    gradient norm, or None when the step was skipped because the loss is not finite."""
    import math

    engine = current().engine
    if loss is not None and not math.isfinite(float(loss)):
        engine.zero_grad()
        return None
    engine.step()
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else 0.0
