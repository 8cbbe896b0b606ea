"""What ``grpolab COMMAND --help`` imports: it runs in a fresh interpreter (nothing imported before it),
which prints the help and then the names of the imported modules the caller asks about."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def help_and_imports(command: str, watched: str) -> tuple[str, list[str]]:
    """``(the help text, the imported modules that are torch or start with watched)``."""
    code = ("import sys\nfrom grpolab.cli import app\n"
            f"try:\n    app(args=[{command!r}, '--help'], prog_name='grpolab')\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in sys.modules if m == 'torch' or m.startswith({watched!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *text, imported = proc.stdout.strip().splitlines()
    return "\n".join(text), ast.literal_eval(imported)
