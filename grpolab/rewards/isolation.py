"""How grader child processes are started so that the current directory cannot inject code.

``python -m pkg`` and ``python -c`` put the working directory first on ``sys.path``: a
``math_verify/`` folder in a run's directory would shadow the installed library and be executed.
Children therefore start with ``python -I script.py`` (no cwd, no script dir, no ``PYTHON*``
variables) and receive their ``sys.path`` from the parent as data: the parent's own path, minus the
working directory. The user-reward worker gets the working directory back, but *last* (after
site-packages): a user's ``mypkg.rewards:fn`` in the run directory still imports, while an
installed package can never be shadowed by a folder of the same name there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

GRPOLAB_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds grpolab/


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def child_sys_path(cwd_last: bool) -> list[str]:
    """The parent's ``sys.path`` without the working directory (and ``''``), absolute, with the
    directory grpolab was imported from appended, so an uninstalled checkout works too; with
    ``cwd_last`` the working directory is appended at the very end."""
    cwd = os.getcwd()
    out: list[str] = []
    for entry in sys.path:
        if entry in ("", ".") or _same_dir(entry, cwd):
            continue
        entry = os.path.abspath(entry)
        if entry not in out:
            out.append(entry)
    if GRPOLAB_ROOT not in out and not _same_dir(GRPOLAB_ROOT, cwd):
        out.append(GRPOLAB_ROOT)
    if cwd_last:
        out.append(cwd)
    return out


def child_command(script: Path) -> list[str]:
    """``python -I <script>``: isolated mode implies ``-P`` (no script dir or cwd on the path)."""
    return [sys.executable, "-I", str(script)]


def describe_exit(returncode: int | None) -> str:
    """"exit code 3" or "signal SIGSEGV (11)" for a child's ``returncode``."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        import signal

        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "signal"
        return f"signal {name} ({-returncode})"
    return f"exit code {returncode}"
