"""``grpolab view`` of a hostile run in a real browser: markup planted in every field of a run
directory (tokens.jsonl, metrics.jsonl, config.yaml, the directory's name) runs nothing and
injects nothing, and the page still draws its charts and step browser (V06-V11)."""

import json
import time
from pathlib import Path

from grpolab.training.run_dir import CONFIG_FILE, METRICS_FILE, RECORDS_FILE
from grpolab.viewer import load_run, write_report

# each sets document.title or adds an element of class xss-probe if it ever becomes markup or script
PAYLOADS = [
    "<img class=xss-probe src=x onerror=\"document.title='XSS-img'\">",
    "</script><script>document.title='XSS-script'</script>",
    "<!--<script>",
    "{{script}}{{data}}{{title}}{{style}}{{csp}}",
    "<svg class=xss-probe onload=\"document.title='XSS-svg'\"></svg>",
    "\"'><b class=xss-probe>x</b>",
    "</title></textarea></style><img class=xss-probe src=x onerror=document.title=/XSS-tpl/.source>",
    "-->]]>\u2028&amp;&lt;",
]
MARK = "".join(PAYLOADS)
NAME = "run <img class=xss-probe src=x onerror=\"document.title='XSS-name'\"> {{data}}{{script}} <!--<script>"
N_TOKENS = len(PAYLOADS) + 1
PROBE = """(() => ({title: document.title, probes: document.querySelectorAll('.xss-probe').length,
  scripts: document.scripts.length, charts: document.querySelectorAll('#charts .chart').length,
  lines: document.querySelectorAll('#charts polyline').length,
  groups: document.querySelectorAll('#groups .group').length,
  tokens: document.querySelectorAll('#groups .tok').length, steps: document.getElementById('step').options.length,
  prompt: (document.querySelector('#groups .prompt') || {}).textContent,
  config: document.getElementById('config').textContent, notes: document.getElementById('notes').textContent,
  error: document.querySelectorAll('.page-error').length}))()"""


def _response() -> dict:
    tokens = [*PAYLOADS, MARK]
    return {"text": MARK, "reward": 1.0, "rewards": {"reward": 1.0, MARK: MARK, f"{MARK}_reward": 0.5},
            "finish": MARK, "tokens": tokens, "advantage": MARK, "sampler_lp": [-0.5] * len(tokens),
            "trainer_lp": MARK, "entropy": [MARK] * len(tokens), "ratio": None, "clipped": [0] * len(tokens),
            "obs": [0] * (len(tokens) - 1) + [1], MARK: MARK}


def _hostile_run(root: Path) -> Path:
    run = root / NAME
    run.mkdir(parents=True)
    (run / CONFIG_FILE).write_text(f"{MARK}: {MARK}\nlearning_rate: 0.001\n")
    inf = float("inf")
    metrics = [{"grpo_step": s, "train/reward": [0.1, inf, 0.3, -inf, 0.5, float("nan"), 0.7][s], "train/kl": 0.01 * s,
                MARK: inf if s == 2 else 1.0, "note": MARK, "eval/accuracy": MARK} for s in range(7)]
    (run / METRICS_FILE).write_text("".join(json.dumps(m) + "\n" for m in metrics))
    groups = [{"step": s, "group": g, "prompt": MARK, "answer": MARK, MARK: MARK,
               "responses": [_response(), _response()]} for s in range(2) for g in range(2)]
    (run / RECORDS_FILE).write_text("".join(json.dumps(g) + "\n" for g in groups))
    return run


def _settled(browser) -> dict:
    """The page's state once image errors and the like had their chance to run a handler."""
    time.sleep(0.5)
    return browser.evaluate(PROBE)


def _assert_inert(state: dict, browser, title: str) -> None:
    assert state["title"] == f"grpolab view: {title}"  # no payload set it
    assert state["probes"] == 0 and state["scripts"] == 2  # no element injected: the data and the page's script
    assert state["error"] == 0 and browser.errors == []


def test_markup_in_every_field_of_a_run_stays_text(tmp_path, chromium):
    run = _hostile_run(tmp_path)
    browser = chromium()
    browser.open(write_report([run]).resolve().as_uri())
    state = _settled(browser)
    _assert_inert(state, browser, NAME)
    assert state["charts"] == 6 and state["steps"] == 2 and state["groups"] == 2
    assert state["lines"] == 4 + 1  # reward: 4 segments (the gaps at steps 1, 3, 5), kl: 1
    assert state["tokens"] == 2 * 2 * N_TOKENS and state["prompt"] == MARK
    assert MARK in state["config"] and "learning_rate: 0.001" in state["config"]
    assert "train/reward: not finite" in state["notes"] and f"{MARK}: not finite" in state["notes"]
    texts = browser.evaluate("[...document.querySelectorAll('#groups .tok')].map(e => e.textContent)")
    assert texts[:N_TOKENS] == [*PAYLOADS, MARK]
    heads = browser.evaluate("[...document.querySelectorAll('#groups .response-head, #groups .group-head')]"
                             ".map(e => e.textContent).join(' ')")
    assert MARK in heads and heads.count(f"answer {MARK}") == 2
    # the step browser pages, recolours and filters with the hostile fields
    browser.evaluate("document.getElementById('next').click()")
    for select, value in (("color", "entropy"), ("color", "gap"), ("filter-response", "truncated")):
        browser.evaluate(f"(() => {{ const s = document.getElementById('{select}'); s.value = '{value}'; "
                         "s.dispatchEvent(new Event('change')); })()")
    browser.evaluate("document.querySelector('#groups .group') && document.querySelector('#groups .tok')"
                     " && document.querySelector('#groups .tok').dispatchEvent(new MouseEvent('mouseover', "
                     "{bubbles: true, clientX: 9, clientY: 9}))")
    _assert_inert(_settled(browser), browser, NAME)


def test_the_script_escapes_fields_the_loader_would_refuse(tmp_path, chromium):
    """The page's script escapes what it draws even where load_run would have refused the data
    (a group or step that is not a number, a response's reward a string): defence in depth (V07)."""
    from grpolab.viewer.report import page, write_atomic

    run = _hostile_run(tmp_path)
    data = {"runs": [load_run(run)]}
    for step in data["runs"][0]["steps"]:
        step["step"] = MARK
        for group in step["groups"]:
            group["group"] = MARK
            for response in group["responses"]:
                response["reward"] = response["rewards"]["reward"] = MARK
    out = tmp_path / "page.html"
    write_atomic(out, page(data))
    browser = chromium()
    browser.open(out.resolve().as_uri())
    state = _settled(browser)
    _assert_inert(state, browser, NAME)
    assert state["groups"] == 2 and state["tokens"] == 2 * 2 * N_TOKENS
    assert browser.evaluate("document.querySelector('#groups .group').dataset.group") == MARK
    assert browser.evaluate("document.getElementById('step').options[0].text").startswith(MARK)
