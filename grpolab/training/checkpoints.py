"""Atomic checkpoints and the final model directory.

Every directory a run writes (``checkpoints/step_N``, ``final/``) is first written to a hidden
temporary directory, fsynced, then renamed into place, so a crash or SIGKILL never leaves a
half-written one under its real name. At the next start, leftovers of an interrupted write are
removed, and a checkpoint that cannot be read is skipped (loudly) in favour of the newest one
that can. The run directory around them (its names, its lock, the checks before a run touches it)
is ``run_dir.py``'s.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ..models import save_model_and_tokenizer
from ..models.loading import config_for_older_loaders, readable_like_save_pretrained
from . import distributed
from .config import ConfigError, resume_changes
from .resources import adopt_saved_dtype
from .sharded_optimizer import check_sharded_files

STATE_FILE = "trainer_state.pt"


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_directory(target: Path, write, every_rank=None) -> Path:
    """Call ``write(tmp_dir)``, fsync it, then move it to ``target`` (replacing an old one).

    The old ``target`` is first renamed aside (``.old_<name>``) and removed after the new one is in
    place, so at every instant one complete directory exists under a known name. In a distributed
    run every rank calls it: ``every_rank(tmp_dir)`` writes each rank's shard into the same
    temporary directory, then rank 0 alone runs ``write``, fsyncs and renames."""
    target = Path(target)
    if every_rank is not None and distributed.current().enabled:
        return _atomic_directory_all_ranks(target, write, every_rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{target.name}_", dir=target.parent))
    try:
        if every_rank is not None:
            every_rank(tmp)
        write(tmp)
        readable_like_save_pretrained(tmp)  # mkdtemp's 0700: final/ and checkpoints readable as any HF directory
        fsync_tree(tmp)
        old = target.with_name(f".old_{target.name}")
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(target, old)
        os.rename(tmp, target)
        fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _atomic_directory_all_ranks(target: Path, write, every_rank) -> Path:
    """The distributed form of ``atomic_directory``: one temporary directory named by rank 0."""
    main = distributed.current().is_main
    tmp = None
    if main:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp_{target.name}_", dir=target.parent)
    tmp = Path(distributed.broadcast_object(tmp))
    every_rank(tmp)
    distributed.barrier()  # every shard is written before rank 0 seals the directory
    if main:
        def seal(final_tmp: Path) -> None:
            _move_contents(tmp, final_tmp)
            write(final_tmp)

        try:
            atomic_directory(target, seal)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    distributed.barrier()
    return target


def _move_contents(src: Path, dst: Path) -> None:
    for p in src.iterdir():
        os.rename(p, dst / p.name)


def remove_leftovers(directory: Path) -> list[Path]:
    """Remove what an interrupted atomic write leaves behind in ``directory``: ``.tmp_*``
    directories (a checkpoint or ``final/`` being written) and ``.old_*`` ones (a replaced
    directory not yet deleted). Returns what was removed."""
    removed = []
    if Path(directory).is_dir():
        for p in Path(directory).iterdir():
            if p.is_dir() and (p.name.startswith(".tmp_") or p.name.startswith(".old_")):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def save_final(model, tokenizer, target: Path, extra=None) -> Path:
    """The final model as an ordinary Hugging Face directory, written atomically; ``extra(tmp)``
    may add files (e.g. PPO's value head)."""

    def write(tmp: Path) -> None:
        save_model_and_tokenizer(model, tokenizer, tmp)
        if extra is not None:
            extra(tmp)

    return atomic_directory(target, write)


class CheckpointManager:
    """Atomic checkpoints ``checkpoints/step_N/``: model + tokenizer (safetensors) and
    ``trainer_state.pt`` (everything else a trainer registered). Only the last ``keep_last`` are
    kept."""

    STATE_FILE = STATE_FILE

    def __init__(self, root: Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, model, tokenizer, state: dict, state_dict: dict | None = None, every_rank=None) -> Path:
        """Write ``checkpoints/step_N``; ``state_dict`` (the full weights, when ``model``'s own are
        sharded or adapted) replaces the module's; ``every_rank(tmp)`` adds per-rank shards."""
        def write(tmp: Path) -> None:
            if state_dict is None:
                save_model_and_tokenizer(model, tokenizer, tmp)
            else:
                model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
                config_for_older_loaders(tmp)
            torch.save(state, tmp / STATE_FILE)

        final = atomic_directory(self.root / f"step_{step}", write, every_rank)
        if not distributed.current().is_main:
            return final
        # keep the newest keep_last up to this one; never the one just written, never a newer one
        older = [p for p in self.all() if int(p.name[5:]) <= step]
        for old in older[: -self.keep_last] if self.keep_last > 0 else []:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def all(self) -> list[Path]:
        """Complete checkpoints (their state file exists), oldest first."""
        if not self.root.exists():
            return []
        done = [p for p in self.root.glob("step_*") if p.name[5:].isdigit() and (p / STATE_FILE).exists()]
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1] if found else None

    def latest_loadable(self) -> tuple[Path, dict] | None:
        """The newest checkpoint whose every part loads (state, weights, and the per-rank optimizer
        shards of an FSDP2 or DeepSpeed run), with its state. Unreadable ones
        (truncated, incomplete, or refused as unsafe) are reported on stderr, skipped, and renamed ``unreadable_step_N``
        (kept for inspection, out of the way of later saves and pruning)."""
        for path in reversed(self.all()):
            try:
                state = self.load_state(path)
                check_model_files(path)
                check_sharded_files(path, state)
            except Exception as exc:  # noqa: BLE001 - any failure to read means "skip this one"
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                aside = path.with_name(f"unreadable_{path.name}")
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(path, aside)
                print(
                    f"grpolab: checkpoint {path} cannot be read ({reason}); moved to {aside.name}, trying an older one",
                    file=sys.stderr,
                )
                continue
            return path, state
        return None

    @staticmethod
    def load_state(path: Path) -> dict:
        return torch.load(Path(path) / STATE_FILE, weights_only=True)


def check_model_files(path: Path) -> None:
    """Raise unless every safetensors file in ``path`` reads completely (header and tensors)."""
    from safetensors.torch import load_file

    files = list(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model weights (*.safetensors) in {path}")
    for f in files:
        load_file(str(f))


def find_resume_checkpoint(ckpts: CheckpointManager, cfg, run_dir: Path) -> tuple[Path, dict]:
    """``--resume``: the newest readable checkpoint and its state, chosen by rank 0 (which alone moves
    unreadable ones aside), if the run's config may continue under ``cfg`` (only the fields
    ``resume_changes`` allows differ, and the run has not done more steps than ``cfg`` asks for)."""
    main = distributed.current().is_main
    found = None
    if main:
        remove_leftovers(ckpts.root)
        found = ckpts.latest_loadable()
    path = distributed.broadcast_object(str(found[0]) if found else None)
    if path is None:
        raise ConfigError(f"{run_dir}: nothing to resume (no readable checkpoint in {ckpts.root})")
    resumed_from = Path(path)
    state = found[1] if found else ckpts.load_state(resumed_from)
    adopt_saved_dtype(cfg, state.get("config", {}))
    changes = resume_changes(state.get("config", {}), cfg.to_dict(), cfg.steps_field)
    if changes.refused:
        raise ConfigError(f"--resume {run_dir}: the run's config cannot change on resume: {changes.refused} "
                          f"(only {', '.join(changes.allowed_keys)} may)")
    done = int(state.get("counters", {}).get("step", 0))
    if done > cfg.total_steps:
        raise ConfigError(f"--resume {run_dir}: the run has done {done} steps, more than "
                          f"{cfg.steps_field} {cfg.total_steps}; give at least {done}")
    if main:
        print(f"grpolab: resuming from {resumed_from}", file=sys.stderr)
    return resumed_from, state
