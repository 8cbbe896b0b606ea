"""``grpolab view`` on hostile or broken run directories: a run's text never becomes markup, a
broken record is one line naming file:line, non-finite figures are gaps with a note, ``--serve``
answers only loopback host names, and the page is written whole or not at all (the page in a real
browser: tests/browser/test_viewer_hostile.py)."""

import contextlib
import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpolab.training.run_dir import CONFIG_FILE, METRICS_FILE, RECORDS_FILE
from grpolab.viewer import ViewError, load_run, render
from grpolab.viewer.report import curves

ROOT = Path(__file__).resolve().parents[2]
DATA_START = '<script type="application/json" id="data">'


def _run(path: Path, metrics: list[dict] | None = None, groups: list[dict] | None = None) -> Path:
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text("learning_rate: 0.001\n")
    metrics = metrics if metrics is not None else [{"grpo_step": s, "train/reward": s / 2} for s in range(3)]
    (path / METRICS_FILE).write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if groups is None:
        groups = [{"step": s, "group": 0, "prompt": "p", "answer": "1", "responses": [_response(["a", "b"])]}
                  for s in range(2)]
    (path / RECORDS_FILE).write_text("".join(json.dumps(g) + "\n" for g in groups))
    return path


def _response(tokens) -> dict:
    return {"reward": 1.0, "rewards": {"reward": 1.0}, "finish": "eos", "tokens": tokens, "advantage": 0.5,
            "sampler_lp": [-0.5] * len(tokens)}


def _payload(page: str) -> str:
    return page.split(DATA_START, 1)[1].split("</script>", 1)[0]


def _strict(text: str):
    """JSON as the browser's JSON.parse reads it: no Infinity, no NaN."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the page's JSON"))


def test_the_template_is_filled_in_one_pass(tmp_path):
    """Placeholder syntax in a run (its directory's name, a token) stays text (V08, V09)."""
    tokens = ["{{script}}", "{{data}}", "{{title}}", "{{style}}", "{{csp}}"]
    run = _run(tmp_path / "{{data}}", groups=[{"step": 0, "group": 0, "prompt": "{{script}}",
                                              "responses": [_response(tokens)]}])
    page = render([run])
    assert page.count("<title>grpolab view:") == 1 and "<title>grpolab view: {{data}}</title>" in page
    assert page.count(DATA_START) == 1 and page.count('"use strict"') == 1  # page.js once, in its own element
    data = _strict(_payload(page))["runs"][0]
    assert data["name"] == "{{data}}" and data["steps"][0]["groups"][0]["responses"][0]["tokens"] == tokens


def test_the_embedded_json_holds_no_markup_character(tmp_path):
    """``<!--`` then ``<script>`` would put the data element in the parser's double-escaped state
    and swallow the page's script (V11): every ``<``, ``>`` and ``&`` is written escaped."""
    tokens = ["<!--", "<script>", "</script>", "a & b", "-->", "\u2028\u2029"]
    run = _run(tmp_path / "run", groups=[{"step": 0, "group": 0, "prompt": "<!--<script>",
                                          "responses": [_response(tokens)]}])
    payload = _payload(render([run]))
    assert not set(payload) & set("<>&\u2028\u2029")
    assert _strict(payload)["runs"][0]["steps"][0]["groups"][0]["responses"][0]["tokens"] == tokens


def test_non_finite_figures_are_gaps_with_a_note(tmp_path):
    """Infinity, -Infinity and NaN (json.dumps writes them; JSON.parse refuses them) are nulls in the
    page's JSON, gaps in the curves, and named in a note (V10)."""
    inf = float("inf")
    metrics = [{"grpo_step": 0, "train/reward": 0.5, "train/lr": 1e-3}, {"grpo_step": 1, "train/reward": inf},
               {"grpo_step": 2, "train/reward": -inf, "train/lr": float("nan")}, {"grpo_step": 3, "train/reward": 1.0},
               {"grpo_step": inf, "train/reward": 2.0}]  # a non-finite step: no point at all
    groups = [{"step": 0, "group": 0, "responses": [{**_response(["a"]), "advantage": inf, "sampler_lp": [-inf],
                                                     "entropy": ["HUGE"]}]}]
    run = _run(tmp_path / "run", metrics, groups)
    text = (run / RECORDS_FILE).read_text()
    (run / RECORDS_FILE).write_text(text.replace('"HUGE"', "1e999"))  # too large for a float: read as inf
    data = load_run(run)
    assert data["curves"]["train/reward"] == [[0, 0.5], [1, None], [2, None], [3, 1.0]]
    assert data["curves"]["train/lr"] == [[0, 0.001], [2, None]]
    notes = "\n".join(data["notes"])
    assert "train/reward: not finite" in notes and "grpo_step 1, 2" in notes and "train/lr" in notes
    assert "tokens.jsonl: 3 non-finite numbers" in notes  # 1e999 too (V13)
    response = _strict(_payload(render([run])))["runs"][0]["steps"][0]["groups"][0]["responses"][0]
    assert response["advantage"] is None and response["sampler_lp"] == [None] and response["entropy"] == [None]
    # a step with a finite value beside a NaN keeps it; many steps: a bucket holding a gap is a gap
    assert curves([{"s": 0, "x": float("nan")}, {"s": 0, "x": 2.0}], "s") == {"x": [[0, 2.0]]}
    many = curves([{"s": i, "y": inf if i == 4321 else 1.0} for i in range(6000)], "s")["y"]
    assert [p[1] for p in many].count(None) == 1 and many[0] == [4.5, 1.0]


def test_numbers_too_large_for_a_float_are_non_finite(tmp_path):
    """(V05) A 401-digit integer as a step or a value is not finite: no point, or a gap with a note."""
    huge = "9" * 401
    run = _run(tmp_path / "run", [])
    lines = [(0, 0.5), (1, huge), (huge, 1.0), (2, 1)]
    (run / METRICS_FILE).write_text("".join(f'{{"grpo_step": {s}, "train/reward": {v}}}\n' for s, v in lines))
    data = load_run(run)
    assert data["curves"]["train/reward"] == [[0, 0.5], [1, None], [2, 1.0]]
    assert any(n.startswith("train/reward: not finite") and "grpo_step 1:" in n for n in data["notes"])
    big = 10**308  # each fits a float, their sum does not: the mean is not finite, a gap
    assert curves([{"s": 0, "x": big}, {"s": 0, "x": big}, {"s": 1, "x": 1}], "s") == {"x": [[0, None], [1, 1.0]]}
    _strict(_payload(render([run])))


def test_the_note_on_non_finite_values_says_what_the_curve_shows(tmp_path):
    """(V08) 0, 1 and Infinity at one step draw 0.5: the note must not call that step a gap."""
    notes: list[str] = []
    assert curves([{"s": 0, "x": v} for v in (0, 1, float("inf"))], "s", notes) == {"x": [[0, 0.5]]}
    assert notes == ["x: not finite (Infinity or NaN) at s 0: those values are left out; "
                     "a step with no finite value is a gap"]


def test_an_overlong_integer_is_a_bad_line(tmp_path):
    """(V06) Over 4300 digits json raises a plain ValueError: it is FILE:LINE like any bad line."""
    for name, line in ((RECORDS_FILE, f'{{"step": {"1" * 5001}, "responses": []}}\n'),
                       (METRICS_FILE, f'{{"grpo_step": 3, "train/reward": {"1" * 5001}}}\n')):
        run = _run(tmp_path / name)
        with open(run / name, "a") as f:
            f.write(line)
        number = len((run / name).read_text().splitlines())
        with pytest.raises(ViewError, match=rf"^{run / name}:{number}: not JSON \(.*4300 digits"):
            load_run(run)


def test_a_non_utf8_directory_name_enters_the_page_as_text(tmp_path):
    """(V16) A byte that is not UTF-8 in a run's name is U+FFFD in the page, never a lone surrogate
    (which crashes the browser's DOM), for the main run and an overlaid one alike."""
    try:
        run = _run(tmp_path / os.fsdecode(b"run\xff"))
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses non-UTF-8 names")
    other = _run(tmp_path / os.fsdecode(b"other\xfe"))
    page = render([run, other])
    page.encode("utf-8")  # strict: no surrogate anywhere in the page
    runs = _strict(_payload(page))["runs"]
    assert [r["name"] for r in runs] == ["run\ufffd", "other\ufffd"]
    assert runs[0]["path"] == str(tmp_path / "run\ufffd") and runs[1]["path"].endswith("other\ufffd")
    assert "\\ud" not in _payload(page).lower() and "<title>grpolab view: run\ufffd vs other\ufffd</title>" in page


@pytest.mark.parametrize("line, problem", [
    ({"step": "abc", "group": 0, "responses": []}, 'step must be an integer, got "abc"'),
    ({"step": True, "responses": []}, "step must be an integer, got true"),
    ({"group": 0, "responses": []}, "step must be an integer, got nothing"),
    ({"step": 0, "group": "<img src=x>", "responses": []}, r'group must be an integer, got "<img src=x>"'),
    ({"step": 0, "group": 0, "responses": [5, "x"]}, "responses[0] must be an object, got 5"),
    ({"step": 0, "group": 0, "responses": {}}, "responses must be a list, got {}"),
    ({"step": 0, "group": 0, "responses": [{"tokens": "abc"}]}, 'responses[0].tokens must be a list, got "abc"'),
    ({"step": 0, "group": 0, "responses": [{"tokens": []}, {}]}, "responses[1].tokens must be a list, got nothing"),
    ({"step": 0, "group": 0, "responses": [{"tokens": [], "rewards": 1}]},
     "responses[0].rewards must be an object, got 1"),
    ([1, 2], "expected a JSON object"),
])
def test_a_bad_token_record_is_one_line_naming_it(tmp_path, line, problem):
    """(V03, V04)"""
    run = _run(tmp_path / "run")
    with open(run / RECORDS_FILE, "a") as f:
        f.write(json.dumps(line) + "\n")
    with pytest.raises(ViewError) as caught:
        load_run(run)
    assert str(caught.value) == f"{run / RECORDS_FILE}:3: {problem}"


def test_undecodable_files_are_named(tmp_path):
    """(V03) Random bytes in tokens.jsonl name the file and line; a config.yaml not UTF-8 names it."""
    run = _run(tmp_path / "run")
    (run / RECORDS_FILE).write_bytes(b'{"step": 0, "responses": []}\n\x94\xff\x00garbage\n')
    with pytest.raises(ViewError, match=rf"^{run / RECORDS_FILE}:2: not UTF-8 text$"):
        load_run(run)
    (run / RECORDS_FILE).unlink()
    (run / CONFIG_FILE).write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ViewError, match=rf"^{run / CONFIG_FILE}: not UTF-8 text"):
        load_run(run)


def test_a_cut_last_line_is_left_out_with_a_note(tmp_path):
    """A run still writing (V02): the cut last line, even mid-character, is dropped and said so."""
    run = _run(tmp_path / "run")
    with open(run / RECORDS_FILE, "ab") as f:
        f.write('{"step": 2, "group": 0, "prompt": "caf\u00e9'.encode()[:-1])
    with open(run / METRICS_FILE, "a") as f:
        f.write('{"grpo_step": 3, "train/rew')
    data = load_run(run)
    assert [s["step"] for s in data["steps"]] == [0, 1] and len(data["curves"]["train/reward"]) == 3
    assert data["notes"] == [f"{name}: the last line is incomplete (a run still writing?): left out"
                             for name in (METRICS_FILE, RECORDS_FILE)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, host: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", "/", skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _wait_for(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"grpolab view --serve did not listen on {port} (exit {proc.poll()}): {proc.stderr.read()}")


def test_serve_answers_only_loopback_host_names(tmp_path):
    """A web page whose name an attacker re-points at 127.0.0.1 (DNS rebinding) sends its own name
    in Host: refused, so it cannot read the run (V13). The real ``grpolab view --serve``."""
    run, port = _run(tmp_path / "run"), _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "grpolab", "view", str(run), "--serve", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_for(proc, port)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
            status, body = _get(port, host)
            assert status == 200 and b"grpolab view" in body, host
        for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1.attacker.example:{port}",
                     "127.0.0.1", f"localhost:{port + 1}", "", None):
            status, body = _get(port, host)
            assert status == 403 and b"learning_rate" not in body and b"train/reward" not in body, host
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def small_file_limit():
    """Files this process writes stop at 4 KiB (a write past it fails, EFBIG): a disk filling up."""
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_failed_write_leaves_the_old_page_and_no_part_of_the_new(tmp_path):
    """(V15) The page is written beside its target and renamed over it: a write cut short by a full
    disk is one line, the earlier page is intact and no partial file is left."""
    from grpolab.cli import app

    run = _run(tmp_path / "run")
    (run / "view.html").write_text("the earlier page")
    with small_file_limit():
        result = CliRunner().invoke(app, ["view", str(run)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip().splitlines() == [f"grpolab: error: cannot write {run / 'view.html'}: File too large"]
    assert (run / "view.html").read_text() == "the earlier page"
    assert sorted(p.name for p in run.iterdir()) == [CONFIG_FILE, METRICS_FILE, RECORDS_FILE, "view.html"]


def test_an_unwritable_target_is_one_line(tmp_path):
    """(V14) A target that cannot be made (its folder is a file; read-only or a full disk alike)."""
    from grpolab.cli import app

    run = _run(tmp_path / "run")
    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(app, ["view", str(run), "--out", str(tmp_path / "afile" / "view.html")])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "cannot write" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["view", str(run), "--out", str(tmp_path)])  # a directory
    assert result.exit_code == 2 and f"cannot write {tmp_path}: " in result.output
    page = tmp_path / "new" / "nested" / "view.html"  # ... while a new nested path is made
    assert CliRunner().invoke(app, ["view", str(run), "--out", str(page)]).exit_code == 0
    assert page.read_text().startswith("<!DOCTYPE html>") and oct(page.stat().st_mode & 0o777) != "0o600"
