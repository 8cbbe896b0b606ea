"""``grpolab view``: one self-contained HTML page from run directories (nothing else is read).

The page holds the runs' data as JSON and a hand-written script (``assets/``) that draws the
curves as inline SVG and the step browser as coloured token spans: no network at view time, no
JavaScript dependency. Large runs stay small: every curve is averaged down to at most
``MAX_POINTS`` points, and at most ``MAX_STEPS`` recorded steps holding about ``MAX_TOKENS``
tokens in all (evenly spaced, the first and last included) are embedded; the page shows one
step's groups at a time.
"""

from __future__ import annotations

import html
import http.server
import json
from importlib import resources
from pathlib import Path

from ..training.run_dir import CONFIG_FILE, METRICS_FILE, RECORDS_FILE, VIEW_FILE

MAX_POINTS = 600  # points per curve
MAX_STEPS = 200  # recorded steps embedded in the page ...
MAX_TOKENS = 500_000  # ... and about this many of their tokens (long responses: fewer steps)
STEP_KEYS = ("grpo_step", "ppo_step", "ei_step", "dpo_step", "sft_step", "train_step", "step")


class ViewError(ValueError):
    """A run directory the viewer cannot read; the message names the file."""


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if number > 1 and not line.endswith("\n"):  # the last line of a run still being written
                    break
                raise ViewError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ViewError(f"{path}:{number}: expected a JSON object")
            out.append(record)
    return out


def _step_key(records: list[dict]) -> str:
    for key in STEP_KEYS:
        if any(key in r for r in records):
            return key
    return "step"


def curves(records: list[dict], step_key: str) -> dict[str, list[list[float]]]:
    """Every numeric figure as [[step, mean over the step's records], ...], averaged into at most
    ``MAX_POINTS`` buckets of steps."""
    sums: dict[str, dict[float, list[float]]] = {}
    for r in records:
        x = r.get(step_key)
        if not isinstance(x, (int, float)):
            continue
        for key, value in r.items():
            if key != step_key and isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                acc = sums.setdefault(key, {}).setdefault(x, [0.0, 0])
                acc[0] += value
                acc[1] += 1
    out = {}
    for key, by_step in sums.items():
        points = sorted((x, s / n) for x, (s, n) in by_step.items())
        size = -(-len(points) // MAX_POINTS)
        out[key] = [[sum(p[0] for p in chunk) / len(chunk), round(sum(p[1] for p in chunk) / len(chunk), 6)]
                    for chunk in (points[i : i + size] for i in range(0, len(points), size))]
    return out


def load_run(run_dir: str | Path) -> dict:
    """A run directory's config, curves and (a sample of) its per-token records, as the page's data."""
    path = Path(run_dir)
    metrics = path / METRICS_FILE
    if not path.is_dir():
        raise ViewError(f"{path}: no such run directory")
    if not metrics.is_file():
        inside = sorted(str(p.parent) for p in path.glob(f"*/{METRICS_FILE}"))
        hint = f"; runs inside it: {', '.join(inside)}" if inside else ""
        raise ViewError(f"{path}: no {METRICS_FILE} (not a run directory){hint}")
    records = _read_jsonl(metrics)
    step_key = _step_key(records)
    config = path / CONFIG_FILE
    steps: dict[int, list[dict]] = {}
    if (path / RECORDS_FILE).is_file():
        for group in _read_jsonl(path / RECORDS_FILE):
            if "step" not in group or not isinstance(group.get("responses"), list):
                raise ViewError(f"{path / RECORDS_FILE}: a record without step or responses")
            steps.setdefault(int(group["step"]), []).append(group)
    kept = sorted(steps)
    tokens = sum(len(r.get("tokens", [])) for groups in steps.values() for g in groups for r in g["responses"])
    limit = max(2, min(MAX_STEPS, MAX_TOKENS * len(kept) // max(tokens, 1)))
    if len(kept) > limit:  # evenly spaced, first and last included
        kept = sorted({kept[round(i * (len(kept) - 1) / (limit - 1))] for i in range(limit)})
    return {"name": path.resolve().name, "path": str(path), "step_key": step_key,
            "config": config.read_text(encoding="utf-8") if config.is_file() else "",
            "curves": curves(records, step_key), "recorded_steps": len(steps),
            "steps": [{"step": s, "groups": steps[s]} for s in kept]}


def _asset(name: str) -> str:
    return resources.files("grpolab.viewer").joinpath("assets", name).read_text(encoding="utf-8")


def render(run_dirs: list[str | Path]) -> str:
    """The page for ``run_dirs`` (the first is the main run; the others are overlaid on its curves)."""
    if not run_dirs:
        raise ViewError("give at least one run directory")
    data = {"runs": [load_run(d) for d in run_dirs]}
    # inside <script>, "</" could end the element: JSON allows the escaped "<\/"
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    title = " vs ".join(r["name"] for r in data["runs"])
    return (_asset("page.html").replace("{{title}}", html.escape(title))
            .replace("{{style}}", _asset("page.css")).replace("{{data}}", payload)
            .replace("{{script}}", _asset("page.js")))


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the page (default: ``view.html`` in the first run directory) and return its path."""
    out = Path(out) if out is not None else Path(run_dirs[0]) / VIEW_FILE
    text = render(run_dirs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


def make_server(run_dirs: list[str | Path], port: int = 0) -> http.server.ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 only, answering ``/`` with the page built afresh from the run
    directories at each request (a run still training shows its latest steps)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            if self.path.split("?")[0] not in ("/", "/index.html"):
                self.send_error(404)
                return
            try:
                body, status = render(run_dirs).encode("utf-8"), 200
            except (ViewError, OSError) as exc:
                body, status = f"grpolab view: {exc}".encode("utf-8"), 500
            self.send_response(status)
            self.send_header("Content-Type", f"text/{'html' if status == 200 else 'plain'}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    return http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
