"""The optimizer state of a sharded run, one piece per rank, in a checkpoint directory: written by
every rank (``save_sharded_optimizer``), checked before a resume trusts the checkpoint
(``check_sharded_files``: every piece there, complete and readable) and read back
(``load_sharded_optimizer``, same world size). FSDP2 keeps it in ``optimizer/``
(``torch.distributed.checkpoint``), DeepSpeed in ``deepspeed/state/`` (``engine.save_checkpoint``,
whose files also hold the partitioned weights); other runs keep their optimizer in
``trainer_state.pt``. Nothing read back is unpickled with code execution (``safe_checkpoint.py``)."""

from __future__ import annotations

from pathlib import Path

from . import distributed
from .safe_checkpoint import SafeUnpickler, safe_dcp_planner, safe_dcp_reader, safe_torch_load


def save_sharded_optimizer(model, optimizer, directory: Path) -> None:
    """Every rank writes its own piece of the optimizer state: FSDP2 with
    ``torch.distributed.checkpoint``, DeepSpeed with ``engine.save_checkpoint`` (its files also
    hold the partitioned weights)."""
    d = distributed.current()
    if d.strategy == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(directory / "optimizer"))
    elif d.strategy == "deepspeed":
        d.engine.save_checkpoint(str(directory / "deepspeed"), tag="state", save_latest=False)


def load_sharded_optimizer(model, optimizer, directory: Path) -> None:
    """The inverse of ``save_sharded_optimizer`` (same world size). Nothing read from the run
    directory is unpickled with code execution: DCP's metadata goes through ``SafeUnpickler`` and
    its non-tensor items, like every DeepSpeed file, through ``torch.load(weights_only=True)``."""
    d = distributed.current()
    if d.strategy == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        meta = directory / "optimizer" / ".metadata"
        with open(meta, "rb") as f:  # refused here in one line, before DCP (which wraps errors in tracebacks)
            SafeUnpickler.load(f, str(meta))
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, storage_reader=safe_dcp_reader(directory / "optimizer"), planner=safe_dcp_planner())
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    elif d.strategy == "deepspeed":
        engine = d.engine.checkpoint_engine
        original = engine.load
        engine.load = lambda path, map_location=None, *args, **kwargs: safe_torch_load(path, map_location)
        try:
            d.engine.load_checkpoint(str(directory / "deepspeed"), tag="state", load_optimizer_states=True,
                                     load_lr_scheduler_states=False, load_module_strict=True)
        finally:
            engine.load = original


def check_sharded_files(path: Path, state: dict) -> None:
    """Raise unless the per-rank optimizer shards of a sharded run are all there and readable:
    FSDP2 (``optimizer/``: DCP metadata, read without executing code, and every file it names, long
    enough for every item), DeepSpeed (``deepspeed/state/``: each rank's files, each loaded with
    ``weights_only=True``). Other runs have none."""
    strategy = (state.get("config") or {}).get("distributed", "none")
    path = Path(path)
    if strategy == "fsdp2" or (path / "optimizer" / ".metadata").exists():
        _check_dcp(path / "optimizer")
    elif strategy == "deepspeed":
        _check_deepspeed(path / "deepspeed" / "state", distributed.current().world_size)


def _check_dcp(directory: Path) -> None:
    meta = directory / ".metadata"
    if not meta.is_file():
        raise FileNotFoundError(f"no optimizer shards metadata ({meta.relative_to(directory.parent)})")
    with open(meta, "rb") as f:
        metadata = SafeUnpickler.load(f, str(meta))
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        name = str(getattr(info, "relative_path", ""))
        needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        f = directory / name
        if not f.is_file() or Path(name).is_absolute() or ".." in Path(name).parts:
            raise FileNotFoundError(f"optimizer shard {directory.name}/{name} is missing")
        if f.stat().st_size < end:
            raise ValueError(
                f"optimizer shard {directory.name}/{name} is truncated ({f.stat().st_size} of {end} bytes)"
            )


def _check_deepspeed(directory: Path, world_size: int) -> None:
    if not directory.is_dir():
        raise FileNotFoundError(f"no DeepSpeed state ({directory.parent.name}/{directory.name}/)")
    for rank in range(world_size):
        optim = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"  # bf16_zero_pp_... with bf16 too
        if not any(p.is_file() for p in directory.glob(f"*{optim}")):
            raise FileNotFoundError(f"DeepSpeed optimizer shard {optim} is missing")
    if not list(directory.glob("*model_states.pt")):
        raise FileNotFoundError(f"DeepSpeed model states (*model_states.pt) missing in {directory}")
    for f in sorted(directory.glob("*.pt")):
        safe_torch_load(f, map_location="cpu")
