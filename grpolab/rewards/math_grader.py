"""Answer equivalence: fast exact-number path, matrices, string normalisation, then math-verify.

``is_equivalent(pred, gold)`` first refuses hedged answers ("not 5", "5 or 6": a hedge word the
reference lacks), then normalises both strings (``normalize.py``). Two plain numbers (integers,
decimals, fractions, mixed numbers, ``1e3``, ``3 million``) are compared exactly with
``fractions.Fraction`` in-process — this covers GSM8K and is thousands of answers per second.
Two matrices (``pmatrix``/``bmatrix``/...) are equal when their shapes are and their entries are,
in order (a transpose is wrong). A number with extra plain words ("18 apples") is refused unless
it equals the reference verbatim — math-verify would drop the words — and so is an answer with
a letter or word the reference cannot account for ("5m" against 5, "2\\pi apples" against
2\\pi). Anything else goes to ``math-verify`` in a persistent worker process with a hard timeout:
a pathological answer (``9^{9^{9}}``) is killed, not waited for, and this works from any thread.
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import threading
from pathlib import Path

from .isolation import child_command, child_sys_path
from .normalize import foreign_words, hedge_words, is_number_with_words, normalize_answer, parse_number

MAX_ANSWER_CHARS = 1000
MAX_BRACE_DEPTH = 40
DEFAULT_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 120.0

_MATRIX_RE = re.compile(
    r"^[(\[]?\s*\\begin\{(pmatrix|bmatrix|Bmatrix|matrix|smallmatrix|array)\}(?:\{[^{}]*\})?"
    r"(.*)\\end\{\1\}\s*[)\]]?$",
    re.DOTALL,
)
_JUXTAPOSED_NUMBERS_RE = re.compile(r"[-+]?[\d./]+(?:\s+[-+]?[\d./]+)+")


def parse_matrix(text: str) -> tuple[tuple[str, ...], ...] | None:
    """Rows of entry strings of a ``\\begin{pmatrix}...\\end{pmatrix}`` (or ``bmatrix``, ``Bmatrix``,
    ``matrix``, ``smallmatrix``, ``array``), or None. ``vmatrix`` is a determinant, not a matrix."""
    m = _MATRIX_RE.match(text.strip())
    if not m:
        return None
    body = m.group(2).replace("\\hline", "")
    rows = [row.strip() for row in body.split("\\\\")]
    while rows and not rows[-1]:
        rows.pop()
    cells = tuple(tuple(c.strip() for c in row.split("&")) for row in rows)
    if not cells or len({len(r) for r in cells}) != 1 or any(not c for r in cells for c in r):
        return None
    return cells


def _too_hostile(s: str) -> bool:
    if len(s) > MAX_ANSWER_CHARS:
        return True
    depth = deepest = 0
    for ch in s:
        if ch in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "})]":
            depth -= 1
    return deepest > MAX_BRACE_DEPTH


def is_equivalent(pred: str, gold: str, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when ``pred`` and ``gold`` are the same mathematical answer."""
    if pred is None:
        return False
    pred, gold = str(pred), str(gold)
    if len(pred) > 20 * MAX_ANSWER_CHARS or hedge_words(pred) - hedge_words(gold):
        return False
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g or _too_hostile(p):
        return False
    if p == g:
        return True
    pn, gn = parse_number(p), parse_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    pm, gm = parse_matrix(p), parse_matrix(g)
    if pm is not None and gm is not None:
        if len(pm) != len(gm) or len(pm[0]) != len(gm[0]):
            return False
        return all(is_equivalent(pc, gc, timeout) for pr, gr in zip(pm, gm) for pc, gc in zip(pr, gr))
    if is_number_with_words(p) or _JUXTAPOSED_NUMBERS_RE.fullmatch(p):
        return False  # "18 apples", "7 8/4": math-verify would read a number out of them
    if foreign_words(p, g):
        return False  # "5m", "2\\pi apples" against 5, 2\\pi: math-verify reads some letters as units
    return _verifier().verify(g, p, timeout)


# ---------------------------------------------------------------- math-verify in a worker process
class MathVerifyWorker:
    """One math-verify child process (``mathverify_worker.py``, started isolated: see
    ``isolation.py``). A call that passes its timeout kills and replaces the child. Independent of
    the caller's ``__main__``, thread and working directory."""

    SCRIPT = Path(__file__).with_name("mathverify_worker.py")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self.timeouts = 0

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            child_command(self.SCRIPT),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self._proc.stdin.write(json.dumps(child_sys_path(cwd_last=False)) + "\n")
        self._proc.stdin.flush()
        # the child imports sympy and math-verify before it answers: not part of any answer's time
        if self._readline(STARTUP_TIMEOUT_S) != "ready":
            self._kill()
            raise RuntimeError("the math-verify worker process did not start (is math-verify installed?)")

    def _readline(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._proc.stdout.readline()
        return line.strip() if line else None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def close(self) -> None:
        """Stop the child (a later ``verify`` starts a new one)."""
        with self._lock:
            self._kill()

    def verify(self, gold: str, pred: str, timeout: float) -> bool:
        """math-verify's verdict on ``pred`` against ``gold``; False when it takes over ``timeout``."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write(json.dumps([gold, pred]) + "\n")
                self._proc.stdin.flush()
                answer = self._readline(timeout)
            except (OSError, ValueError):
                answer = None
            if answer in ("0", "1"):
                return answer == "1"
            self.timeouts += 1
            self._kill()
            return False


_WORKER: MathVerifyWorker | None = None
_WORKER_LOCK = threading.Lock()


def _verifier() -> MathVerifyWorker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = MathVerifyWorker()
        return _WORKER


def shutdown_math_verify() -> None:
    """Stop the shared math-verify child; the next comparison that needs it starts a fresh one
    (in the then-current working directory: what the isolation test exercises)."""
    with _WORKER_LOCK:
        if _WORKER is not None:
            _WORKER.close()
