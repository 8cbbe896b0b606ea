"""Atomic checkpoints and the final model directory.

Every directory a run writes (``checkpoints/step_N``, ``final/``) is first written to a hidden
temporary directory, fsynced, then renamed into place, so a crash or SIGKILL never leaves a
half-written one under its real name. At the next start, leftovers of an interrupted write are
removed, and a checkpoint that cannot be read is skipped (loudly) in favour of the newest one
that can. The run directory itself is checked here before a run touches it (``check_run_dir``:
no run is silently replaced) and cleared on ``--overwrite`` (``clear_run_dir``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ..models import save_model_and_tokenizer
from .config import ConfigError

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
    from . import distributed

    target = Path(target)
    if every_rank is not None and distributed.current().enabled:
        return _atomic_directory_all_ranks(target, write, every_rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{target.name}_", dir=target.parent))
    try:
        if every_rank is not None:
            every_rank(tmp)
        write(tmp)
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
    from . import distributed

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
        from . import distributed

        def write(tmp: Path) -> None:
            if state_dict is None:
                save_model_and_tokenizer(model, tokenizer, tmp)
            else:
                model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
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


def check_sharded_files(path: Path, state: dict) -> None:
    """Raise unless the per-rank optimizer shards of a sharded run are all there and readable:
    FSDP2 (``optimizer/``: DCP metadata, read without executing code, and every file it names, long
    enough for every item), DeepSpeed (``deepspeed/state/``: each rank's files, each loaded with
    ``weights_only=True``). Other runs have none."""
    from . import distributed

    strategy = (state.get("config") or {}).get("distributed", "none")
    path = Path(path)
    if strategy == "fsdp2" or (path / "optimizer" / ".metadata").exists():
        _check_dcp(path / "optimizer")
    elif strategy == "deepspeed":
        _check_deepspeed(path / "deepspeed" / "state", distributed.current().world_size)


def _check_dcp(directory: Path) -> None:
    from .safe_checkpoint import SafeUnpickler

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
    from .safe_checkpoint import safe_torch_load

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


# ---------------------------------------------------------------- the run directory

RUN_FILES = ("metrics.jsonl", "checkpoints", "final")


def holds_a_run(path: Path) -> bool:
    """A directory holds a run when it has metrics, checkpoints or a final model."""
    metrics = path / "metrics.jsonl"
    return ((metrics.is_file() and metrics.stat().st_size > 0) or any((path / "checkpoints").glob("step_*"))
            or (path / "final").exists())


def check_run_dir(path: Path, resume: bool, overwrite: bool) -> None:
    """Refuse, before anything is touched, a run directory we must not (or cannot) write."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir {path}: exists and is not a directory")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"run_dir {path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir {path}: {probe} is not writable")
    if not resume and not overwrite and path.is_dir() and holds_a_run(path):
        raise ConfigError(f"run_dir {path} already holds a run: continue it with --resume {path}, or replace it "
                          "with --overwrite")


def clear_run_dir(path: Path) -> None:
    """``overwrite``: remove a previous run's files (only the ones a run writes)."""
    for name in (*RUN_FILES, "samples", "tensorboard", "curves.png", "config.yaml", "tokens.jsonl", "view.html"):
        p = path / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()



# ---------------------------------------------------------------- one writer per run directory

LOCK_FILE = ".lock"


class RunDirBusy(ConfigError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive ``flock`` on ``run_dir/.lock`` (the holder's pid written in it), held for the
    run's lifetime. The kernel drops it when the holder exits, however it exits (SIGKILL too), so a
    lock file left behind never blocks; a live holder refuses a second run, ``--resume`` or
    ``--overwrite`` in one line naming its pid."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None
        self.created = False  # the lock file did not exist before

    def check_free(self) -> None:
        """Raise ``RunDirBusy`` if a live process holds the lock; touches nothing (the lock file is
        only opened for reading, and only if it exists)."""
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return  # no lock file (or none we could hold either: acquire says so)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise self._busy(fd) from None
        finally:
            os.close(fd)  # closing drops a lock taken just now

    def _busy(self, fd: int) -> RunDirBusy:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        return RunDirBusy(f"run_dir {self.run_dir} is in use by another grpolab process (pid {holder}); wait for it "
                          "to end or stop it first")

    def acquire(self) -> RunLock:
        import fcntl

        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            try:
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
                self.created = True
            except FileExistsError:
                fd = os.open(self.path, flags)
        except OSError as exc:
            raise ConfigError(
                f"run_dir {self.run_dir}: cannot open its lock file {self.path} ({exc.strerror})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            busy = self._busy(fd)
            os.close(fd)
            raise busy from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self, remove: bool = False) -> None:
        """Drop the lock; ``remove``: a run that never started also removes the lock file it created
        (the directory is left as it was found)."""
        if self.fd is None:
            return
        import fcntl

        try:
            os.ftruncate(self.fd, 0)
            if remove and self.created:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None
