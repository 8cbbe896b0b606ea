"""The run directory: what a run writes where, one writer at a time, and the checks before a run
touches it.

A run directory holds everything of a run, under the names below: ``config.yaml`` (the run's
validated config), ``metrics.jsonl`` (one JSON object per record), ``tokens.jsonl`` (per-token
records for ``grpolab view``), ``samples/`` (validation generations), ``checkpoints/step_N/``,
``final/`` (a Hugging Face model directory), ``curves.png``, ``tensorboard/`` (``report_to``),
``view.html`` (``grpolab view``) and ``.lock``.

A run that would replace one is refused unless resuming or ``overwrite`` (``check_run_dir``), and
always while another process holds the lock (``RunLock``: held by rank 0 for the run's lifetime,
naming the holder's pid); ``claim_run_dir`` takes both steps in order, on every rank.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .config import ConfigError

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
RECORDS_FILE = "tokens.jsonl"
SAMPLES_DIR = "samples"
CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
PLOT_FILE = "curves.png"
TENSORBOARD_DIR = "tensorboard"  # written by metric_logging.MetricsLogger
WANDB_ID_FILE = "wandb_run_id"  # the W&B run a resumed run continues (metric_logging.MetricsLogger)
VIEW_FILE = "view.html"  # written by grpolab view
LOCK_FILE = ".lock"

# what makes a directory hold a run (``holds_a_run``)
RUN_FILES = (METRICS_FILE, CHECKPOINTS_DIR, FINAL_DIR)


def holds_a_run(path: Path) -> bool:
    """A directory holds a run when it has metrics, checkpoints or a final model."""
    metrics = path / METRICS_FILE
    return ((metrics.is_file() and metrics.stat().st_size > 0) or any((path / CHECKPOINTS_DIR).glob("step_*"))
            or (path / FINAL_DIR).exists())


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
    for name in (*RUN_FILES, SAMPLES_DIR, TENSORBOARD_DIR, WANDB_ID_FILE, PLOT_FILE, CONFIG_FILE, RECORDS_FILE,
                 VIEW_FILE):
        p = path / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


# ---------------------------------------------------------------- one writer per run directory


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


class RunDirClaim:
    """A run's hold on its directory: rank 0's lock, and whether the run created the directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock: RunLock | None = None
        self.made_dir = False

    def release(self, started: bool = True) -> None:
        """Release the lock; a directory this run created and never used is removed again."""
        if self.lock is not None:
            self.lock.release(remove=not started)
            self.lock = None
        if self.made_dir and not started:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self.made_dir = False


def claim_run_dir(path: Path, resume: bool, overwrite: bool, is_main: bool) -> RunDirClaim:
    """Every rank calls it, before anything in ``path`` is touched: a writable directory (or place
    for one); then rank 0 takes ``path/.lock`` (creating the directory if need be) — a directory a
    live process holds is refused on every rank with the holder's pid, one that holds a run (without
    ``--resume``/``--overwrite``) with the usual hint, both before anything is created; then the
    checks again, now that no other process can write it."""
    from . import distributed  # here, not at the top: grpolab view reads this module's names without torch

    check_run_dir(path, resume=True, overwrite=True)
    claim, error = RunDirClaim(path), None
    if is_main:
        try:
            RunLock(path).check_free()
            check_run_dir(path, resume, overwrite)
            if not path.exists():
                path.mkdir(parents=True)
                claim.made_dir = True
            claim.lock = RunLock(path).acquire()
        except ConfigError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"run_dir {path}: cannot create it ({exc.strerror or exc})"
    error = distributed.broadcast_object(error)
    if error is not None:
        claim.release(started=False)
        raise RunDirBusy(error) if "is in use by" in error else ConfigError(error)
    try:
        check_run_dir(path, resume, overwrite)
    except BaseException:
        claim.release(started=False)
        raise
    return claim


def prepare_run_dir(path: Path, config: dict, clear: bool) -> None:
    """Rank 0, once every input, the model and the checkpoint to resume from have been checked: the
    directory made (a previous run's files removed first when ``clear``: ``--overwrite``), the
    leftovers of an interrupted atomic write removed, and the run's config written."""
    import yaml

    from .checkpoints import atomic_write_text, remove_leftovers  # as distributed in claim_run_dir: no torch at import

    if clear:
        clear_run_dir(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / SAMPLES_DIR).mkdir(exist_ok=True)
    remove_leftovers(path)
    remove_leftovers(path / CHECKPOINTS_DIR)
    atomic_write_text(path / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))
