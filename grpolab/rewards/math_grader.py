"""Answer equivalence: fast exact-number path, string normalisation, then math-verify.

``is_equivalent(pred, gold)`` first normalises both strings (the clean-ups math-verify lacks:
``\\text{}`` and units, thousands separators, ``\\dfrac``/``\\tfrac``, ``$``, percent and degree
signs, ``x = 5``, unicode minus, trailing period). Two plain numbers (integers, decimals,
fractions) are compared exactly with ``fractions.Fraction`` in-process — this covers GSM8K and is
thousands of answers per second. Anything else goes to ``math-verify`` in a persistent worker
process with a hard timeout: a pathological answer (``9^{9^{9}}``) is killed, not waited for,
and this works from any thread (math-verify's own ``signal.alarm`` timeout works only on the main
thread, and cannot interrupt a long C-level big-integer operation anyway).
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction

MAX_ANSWER_CHARS = 1000
MAX_BRACE_DEPTH = 40
DEFAULT_TIMEOUT_S = 5.0

_NUMBER = r"-?(?:\d+(?:\.\d*)?|\.\d+)"
_NUM_RE = re.compile(rf"^{_NUMBER}$")
_SLASH_FRAC_RE = re.compile(rf"^({_NUMBER})\s*/\s*({_NUMBER})$")
_LATEX_FRAC_RE = re.compile(r"^(-?)\\frac(?:\{(-?\d+)\}|(\d))(?:\{(-?\d+)\}|(\d))$")
_THOUSANDS_RE = re.compile(r"(?<![\d.])(-?\d{1,3}(?:,\d{3})+)(?![\d])")
_TEXT_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox|mathbf)\s*\{([^{}]*)\}")
_UNIT_AFTER_NUMBER_RE = re.compile(rf"^({_NUMBER}(?:\s*/\s*{_NUMBER})?)\s+[A-Za-z][A-Za-z .]*$")
_VAR_EQ_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?!=)")


def normalize_answer(text: str) -> str:
    """Canonical surface form of an answer string (see the module docstring)."""
    s = str(text).strip()
    s = s.replace("\u2212", "-").replace("\u2013", "-").replace("\u00a0", " ")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    for space in ("\\!", "\\,", "\\;", "\\:", "\\ ", "~"):
        s = s.replace(space, " " if space != "\\!" else "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s).replace("°", "").replace("\\degree", "")
    # \text{ cm} after a number is a unit; \text{...} alone keeps its content.
    s = re.sub(r"(\d)\s*\\(?:text|mbox|mathrm)\s*\{[^{}]*\}\s*$", r"\1", s)
    s = _TEXT_RE.sub(r"\1", s)
    s = s.strip()
    s = _VAR_EQ_RE.sub("", s, count=1)
    s = s.strip().rstrip(".").strip()
    s = s.replace("{,}", ",")
    s = _THOUSANDS_RE.sub(lambda m: m.group(1).replace(",", ""), s)
    unit = _UNIT_AFTER_NUMBER_RE.match(s)
    if unit:
        s = unit.group(1)
    return s.strip()


def parse_number(text: str) -> Fraction | None:
    """A normalised answer as an exact ``Fraction`` when it is a plain number, else None."""
    s = text.replace(" ", "")
    if s.startswith("+"):
        s = s[1:]
    try:
        if _NUM_RE.match(s):
            return Fraction(s)
        m = _SLASH_FRAC_RE.match(s)
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den else None
        m = _LATEX_FRAC_RE.match(s)
        if m:
            num = int(m.group(2) or m.group(3))
            den = int(m.group(4) or m.group(5))
            if den == 0:
                return None
            value = Fraction(num, den)
            return -value if m.group(1) else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


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
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g or _too_hostile(p):
        return False
    if p == g:
        return True
    pn, gn = parse_number(p), parse_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    return _verifier().verify(g, p, timeout)


# ---------------------------------------------------------------- math-verify in a worker process
def _math_verify_equal(gold: str, pred: str) -> bool:
    """math-verify's verdict without its signal-based timeouts (the caller bounds the time)."""
    from math_verify import parse, verify

    try:
        g = parse(f"${gold}$", parsing_timeout=None)
        p = parse(f"${pred}$", parsing_timeout=None)
        return bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=None))
    except Exception:
        return False


def _worker_loop() -> None:  # pragma: no cover - runs in the child process
    """Child side: one JSON request per stdin line, one JSON verdict per stdout line."""
    import logging

    logging.disable(logging.WARNING)  # math-verify warns on every call without a timeout
    _math_verify_equal("1", "1")  # import and warm up before saying ready
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        gold, pred = json.loads(line)
        out.write("1\n" if _math_verify_equal(gold, pred) else "0\n")
        out.flush()


class _MathVerifyWorker:
    """One math-verify child process (``python -m grpolab.rewards.math_grader``). A call that passes
    its timeout kills and replaces the child. Independent of the caller's ``__main__`` and thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self.timeouts = 0

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "grpolab.rewards.math_grader"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        # the child imports sympy and math-verify before it answers: not part of any answer's time
        if self._readline(120) != "ready":
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

    def verify(self, gold: str, pred: str, timeout: float) -> bool:
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


_WORKER: _MathVerifyWorker | None = None
_WORKER_LOCK = threading.Lock()


def _verifier() -> _MathVerifyWorker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = _MathVerifyWorker()
        return _WORKER


if __name__ == "__main__":  # pragma: no cover
    _worker_loop()
