"""``grpolab view``: one self-contained HTML page from run directories (nothing else is read).

The page holds the runs' data as JSON and a hand-written script (``assets/``) that draws the
curves as inline SVG and the step browser as coloured token spans: no network at view time, no
JavaScript dependency. Large runs stay small: every curve is averaged down to at most
``MAX_POINTS`` points, and at most ``MAX_STEPS`` recorded steps holding about ``MAX_TOKENS``
tokens in all (evenly spaced, the first and last included) are embedded; the page shows one
step's groups at a time.

A run directory's text is data, never markup: the placeholders of ``page.html`` are filled in one
pass over the template (text put in is never searched again), the JSON escapes every ``<``, ``>``
and ``&`` (nothing in it can end or re-open its ``<script>`` element), the script escapes every
field where it enters the DOM, and the page's Content-Security-Policy runs only its own script
(by hash: no inline handler, nothing fetched). Non-finite figures (Infinity, NaN) become gaps in
the curves, with a note on the page naming them; so do the other oddities a run can hold.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import http.server
import json
import math
import os
import re
import tempfile
from importlib import resources
from pathlib import Path

from ..training.run_dir import CONFIG_FILE, METRICS_FILE, RECORDS_FILE, VIEW_FILE

MAX_POINTS = 600  # points per curve
MAX_STEPS = 200  # recorded steps embedded in the page ...
MAX_TOKENS = 500_000  # ... and about this many of their tokens (long responses: fewer steps)
STEP_KEYS = ("grpo_step", "ppo_step", "ei_step", "dpo_step", "sft_step", "train_step", "step")
NOTE_STEPS = 10  # steps named in a note about non-finite figures
PLACEHOLDER = re.compile(r"\{\{(title|csp|style|data|script)\}\}")
JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
MISSING = object()


class ViewError(ValueError):
    """A run directory the viewer cannot read, or a page it cannot write; the message names the file."""


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    """Whether a number is finite as a float (an integer too large for a float is not: 10**400)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _text(name: str) -> str:
    """A path or name as the page may hold it: bytes that are not UTF-8 (read as lone surrogates)
    become U+FFFD (a lone surrogate in the page's JSON breaks the browser's DOM)."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that no file name decodes to
        return name.encode("utf-8", "replace").decode("utf-8")


def _shown(value) -> str:
    return "nothing" if value is MISSING else json.dumps(value)[:40]


def _read_jsonl(path: Path, notes: list[str], check=None, constant=None, real=None) -> list[dict]:
    """The JSON objects of ``path``, one a line. A bad line is a ``ViewError`` naming ``path:line``
    (``check(record)`` -> a problem or None), except a cut last line (a run still writing): left
    out, with a note. ``constant``, ``real``: json's ``parse_constant`` (for Infinity, -Infinity,
    NaN) and ``parse_float``."""
    out = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                record = json.loads(line, parse_constant=constant, parse_float=real) if line.strip() else MISSING
            except ValueError as exc:  # not UTF-8, not JSON, an integer of over 4300 digits
                if number > 1 and not raw.endswith(b"\n"):  # the last line of a run still being written
                    notes.append(f"{path.name}: the last line is incomplete (a run still writing?): left out")
                    break
                reason = ("not UTF-8 text" if isinstance(exc, UnicodeDecodeError)
                          else f"not JSON ({exc.msg if isinstance(exc, json.JSONDecodeError) else exc})")
                raise ViewError(f"{path}:{number}: {reason}") from None
            if record is MISSING:
                continue
            problem = "expected a JSON object" if not isinstance(record, dict) else check(record) if check else None
            if problem:
                raise ViewError(f"{path}:{number}: {problem}")
            out.append(record)
    return out


def _check_group(record: dict) -> str | None:
    """What is wrong with one ``tokens.jsonl`` record (a group of one step), or None."""
    for key, required in (("step", True), ("group", False)):
        value = record.get(key, MISSING)
        if (required or value is not MISSING) and not _integer(value):
            return f"{key} must be an integer, got {_shown(value)}"
    responses = record.get("responses", MISSING)
    if not isinstance(responses, list):
        return f"responses must be a list, got {_shown(responses)}"
    for i, response in enumerate(responses):
        if not isinstance(response, dict):
            return f"responses[{i}] must be an object, got {_shown(response)}"
        if not isinstance(tokens := response.get("tokens", MISSING), list):
            return f"responses[{i}].tokens must be a list, got {_shown(tokens)}"
        if not isinstance(rewards := response.get("rewards", {}), dict):
            return f"responses[{i}].rewards must be an object, got {_shown(rewards)}"
    return None


def _step_key(records: list[dict]) -> str:
    for key in STEP_KEYS:
        if any(key in r for r in records):
            return key
    return "step"


def _nonfinite_note(key: str, step_key: str, steps: list[float]) -> str:
    named = ", ".join(f"{x:g}" for x in steps[:NOTE_STEPS])
    more = f" and {len(steps) - NOTE_STEPS} more" if len(steps) > NOTE_STEPS else ""
    return (f"{key}: not finite (Infinity or NaN) at {step_key} {named}{more}: those values are left out; "
            "a step with no finite value is a gap")


def _buckets(points: list[tuple[float, float | None]]) -> list[list[float | None]]:
    """``points`` averaged into at most ``MAX_POINTS`` buckets; a bucket holding a gap is a gap."""
    size = -(-len(points) // MAX_POINTS)
    out = []
    for chunk in (points[i : i + size] for i in range(0, len(points), size)):
        ys = [y for _, y in chunk]
        y = None if None in ys else sum(ys) / len(ys)
        x = sum(float(x) for x, _ in chunk) / len(chunk)
        out.append([x, round(y, 6) if y is not None and math.isfinite(y) else None])
    return out


def curves(records: list[dict], step_key: str, notes: list[str] | None = None) -> dict[str, list[list]]:
    """Every numeric figure as [[step, mean over the step's records], ...], averaged into at most
    ``MAX_POINTS`` buckets of steps. Non-finite values (and numbers too large for a float) are left
    out of the mean; a step with no finite value is a gap (null); each figure with non-finite values
    gets a note in ``notes``. A record whose step is not finite is left out."""
    sums: dict[str, dict[float, list]] = {}
    for r in records:
        x = r.get(step_key)
        if not _number(x) or not _finite(x):
            continue
        for key, value in r.items():
            if key != step_key and _number(value):
                acc = sums.setdefault(key, {}).setdefault(x, [0.0, 0, False])  # sum, count, a non-finite value
                if _finite(value):
                    acc[0] += float(value)
                    acc[1] += 1
                else:
                    acc[2] = True
    out = {}
    for key, by_step in sums.items():
        out[key] = _buckets(sorted((x, s / n if n else None) for x, (s, n, _) in by_step.items()))
        bad = sorted(x for x, (_, _, nonfinite) in by_step.items() if nonfinite)
        if bad and notes is not None:
            notes.append(_nonfinite_note(key, step_key, bad))
    return out


def _nulled(value):
    """``value`` with every non-finite float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _nulled(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nulled(v) for v in value]
    return value


def _sampled(steps: dict[int, list[dict]]) -> list[int]:
    """The recorded steps the page embeds: evenly spaced, first and last included, about ``MAX_TOKENS``."""
    kept = sorted(steps)
    tokens = sum(len(r["tokens"]) for groups in steps.values() for g in groups for r in g["responses"])
    limit = max(2, min(MAX_STEPS, MAX_TOKENS * len(kept) // max(tokens, 1)))
    if len(kept) > limit:
        kept = sorted({kept[round(i * (len(kept) - 1) / (limit - 1))] for i in range(limit)})
    return kept


def _read_config(path: Path) -> str:
    if not path.is_file():
        return ""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ViewError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def load_run(run_dir: str | Path) -> dict:
    """A run directory's config, curves and (a sample of) its per-token records, as the page's data;
    ``notes``: what the page should say about them (non-finite figures, a cut last line)."""
    path = Path(run_dir)
    metrics = path / METRICS_FILE
    if not path.is_dir():
        raise ViewError(f"{path}: no such run directory")
    if not metrics.is_file():
        inside = sorted(str(p.parent) for p in path.glob(f"*/{METRICS_FILE}"))
        hint = f"; runs inside it: {', '.join(inside)}" if inside else ""
        raise ViewError(f"{path}: no {METRICS_FILE} (not a run directory){hint}")
    notes: list[str] = []
    records = _read_jsonl(metrics, notes)
    step_key = _step_key(records)
    config = _read_config(path / CONFIG_FILE)
    steps: dict[int, list[dict]] = {}
    nonfinite: list[str] = []  # Infinity, NaN in the records: read as null

    def constant(name: str) -> None:
        nonfinite.append(name)

    def real(text: str) -> float:  # 1e400: json reads it as inf, not through parse_constant
        value = float(text)
        if not math.isfinite(value):
            nonfinite.append(text)
        return value

    if (path / RECORDS_FILE).is_file():
        for group in _read_jsonl(path / RECORDS_FILE, notes, _check_group, constant, real):
            steps.setdefault(group["step"], []).append(group)
    if nonfinite:
        notes.append(f"{RECORDS_FILE}: {len(nonfinite)} non-finite numbers (Infinity or NaN) shown as n/a")
    return {"name": _text(path.resolve().name), "path": _text(str(path)), "step_key": step_key, "config": config,
            "curves": curves(records, step_key, notes), "recorded_steps": len(steps),
            "steps": [{"step": s, "groups": steps[s]} for s in _sampled(steps)], "notes": notes}


def _asset(name: str) -> str:
    return resources.files("grpolab.viewer").joinpath("assets", name).read_text(encoding="utf-8")


def script_json(data) -> str:
    """``data`` as JSON that is inert inside a ``<script>`` element: no ``<``, ``>`` or ``&`` (so no
    ``</script>``, ``<!--`` or ``<script``), no Infinity or NaN (``JSON.parse`` rejects them)."""
    try:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a number too large for a float (1e999) was read as inf
        text = json.dumps(_nulled(data), separators=(",", ":"), allow_nan=False)
    return re.sub("[<>&\u2028\u2029]", lambda m: JSON_ESCAPES[m.group()], text)


def page(data: dict) -> str:
    """The page for the data of ``load_run`` (``{"runs": [...]}``)."""
    script = _asset("page.js")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    title = " vs ".join(r["name"] for r in data["runs"]).encode("utf-8", "backslashreplace").decode("utf-8")
    parts = {"title": html.escape(title), "style": _asset("page.css"), "data": script_json(data), "script": script,
             "csp": f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
                    "base-uri 'none'; form-action 'none'"}
    return PLACEHOLDER.sub(lambda m: parts[m.group(1)], _asset("page.html"))  # one pass: no re-substitution


def render(run_dirs: list[str | Path]) -> str:
    """The page for ``run_dirs`` (the first is the main run; the others are overlaid on its curves)."""
    if not run_dirs:
        raise ViewError("give at least one run directory")
    return page({"runs": [load_run(d) for d in run_dirs]})


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(out: Path, text: str) -> None:
    """Write ``out`` whole or not at all (a temporary file beside it, then renamed over it): a full
    disk or a read-only directory is a ``ViewError`` and leaves any earlier page as it was."""
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        with open(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
        tmp = None
    except OSError as exc:
        raise ViewError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the page (default: ``view.html`` in the first run directory) and return its path."""
    text = render(run_dirs)
    out = Path(out) if out is not None else Path(run_dirs[0]) / VIEW_FILE
    write_atomic(out, text)
    return out


def host_allowed(host: str | None, port: int) -> bool:
    """Whether a request's ``Host`` header names this machine's loopback (a page of another site
    whose name was re-pointed at 127.0.0.1, DNS rebinding, sends its own name)."""
    allowed = {f"{name}:{port}" for name in LOCAL_HOSTS} | (set(LOCAL_HOSTS) if port == 80 else set())
    return host is not None and host.strip().lower() in allowed


def make_server(run_dirs: list[str | Path], port: int = 0) -> http.server.ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 only, answering ``/`` with the page built afresh from the run
    directories at each request (a run still training shows its latest steps). A request naming
    another host than 127.0.0.1, localhost or [::1] (with the port) is refused (403)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self, status: int, body: bytes, kind: str = "plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", f"text/{kind}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - the http.server API
            port = self.server.server_address[1]
            if not host_allowed(self.headers.get("Host"), port):
                self._reply(403, f"grpolab view: only http://127.0.0.1:{port}/ is served here\n".encode())
                return
            if self.path.split("?")[0] not in ("/", "/index.html"):
                self.send_error(404)
                return
            try:
                body, status = render(run_dirs).encode("utf-8"), 200
            except (ViewError, OSError) as exc:
                body, status = _text(f"grpolab view: {exc}").encode("utf-8"), 500
            self._reply(status, body, "html" if status == 200 else "plain")

        def log_message(self, *args) -> None:
            pass

    return http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
