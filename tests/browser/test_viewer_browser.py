"""``grpolab view`` in a real browser: a short demo run (SFT warm-up, then GRPO with the demo's
settings) is rendered and loaded in headless Chromium with JavaScript on."""

import json
from pathlib import Path

import pytest

from grpolab.training.run_dir import RECORDS_FILE
from grpolab.viewer import write_report

TOKENS = "[...document.querySelectorAll('#groups .tok')]"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """A real demo run, short: 60 SFT steps, 3 GRPO steps of 128 rollouts, 10 test questions."""
    from grpolab.experiments.demo import run_demo

    run_dir = tmp_path_factory.mktemp("viewer") / "demo"
    run_demo(run_dir, sft_steps=60, grpo_steps=3, test_examples=10, show_progress=False)
    return run_dir


def _records(run: Path) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for line in (run / RECORDS_FILE).read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], []).append(record)
    return steps


def _select(browser, element_id: str, value: str) -> None:
    browser.evaluate(f"(() => {{ const s = document.getElementById({element_id!r}); s.value = {value!r}; "
                     "s.dispatchEvent(new Event('change')); })()")


def test_page_shows_groups_and_tokens_and_recolours(demo_run, chromium):
    run = demo_run / "grpo"
    steps = _records(run)
    page = write_report([run])
    browser = chromium()
    browser.open(page.resolve().as_uri())
    first = steps[min(steps)]
    assert browser.evaluate("document.querySelectorAll('#groups .group').length") == len(first) == 2
    n_tokens = sum(len(r["tokens"]) for g in first for r in g["responses"])
    assert browser.evaluate(f"{TOKENS}.length") == n_tokens
    assert browser.evaluate("document.querySelectorAll('#groups .response').length") == 2 * 8
    # advantage x ratio is known for every token: every one is coloured
    by_advantage = browser.evaluate(f"{TOKENS}.map(e => e.style.backgroundColor)")
    assert all(c.startswith("rgb") for c in by_advantage)
    _select(browser, "color", "logprob")
    by_logprob = browser.evaluate(f"{TOKENS}.map(e => e.style.backgroundColor)")
    assert all(c.startswith("rgb") for c in by_logprob) and by_logprob != by_advantage
    assert len({c for c in by_logprob}) > 5  # a scale, not one colour
    _select(browser, "color", "entropy")
    by_entropy = browser.evaluate(f"{TOKENS}.map(e => e.style.backgroundColor)")
    assert by_entropy != by_logprob
    # the entropy is known exactly on the rows the update trained (the others show as not measured)
    trained = [r["entropy"][0] is not None for g in first for r in g["responses"] for _ in r["tokens"]]
    assert [c != "" for c in by_entropy] == trained
    # hover details
    tip = browser.evaluate(f"(() => {{ {TOKENS}[0].dispatchEvent(new MouseEvent('mouseover', {{bubbles: true, "
                           "clientX: 50, clientY: 50})); const t = document.getElementById('tip'); "
                           "return t.hidden ? null : t.textContent; })()")
    assert tip is not None and "sampler" in tip and "advantage" in tip
    # the step browser pages through the recorded steps
    browser.evaluate("document.getElementById('next').click()")
    second = steps[sorted(steps)[1]]
    assert browser.evaluate(f"{TOKENS}.length") == sum(len(r["tokens"]) for g in second for r in g["responses"])
    assert browser.errors == []
    browser.evaluate("document.getElementById('groups').dispatchEvent(new MouseEvent('mouseleave'))")
    assert browser.evaluate("document.getElementById('tip').hidden")
    shot = browser.screenshot(run / "view.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_filters_follow_the_records(demo_run, chromium):
    run = demo_run / "grpo"
    first = _records(run)[0]
    browser = chromium()
    browser.open(write_report([run]).resolve().as_uri())
    zero = sum(len({r["reward"] for r in g["responses"]}) == 1 for g in first)
    _select(browser, "filter-group", "zero")
    assert browser.evaluate("document.querySelectorAll('#groups .group').length") == zero
    _select(browser, "filter-group", "all")
    wrong = sum(r["rewards"]["answer_reward"] <= 0.5 for g in first for r in g["responses"])
    _select(browser, "filter-response", "wrong")
    assert browser.evaluate("document.querySelectorAll('#groups .response').length") == wrong
    assert browser.evaluate("document.querySelectorAll('#groups .response.correct').length") == 0
    assert browser.errors == []


def test_two_runs_overlaid(demo_run, chromium, tmp_path):
    """The GRPO run with the SFT run beside it: both runs' curves share the charts, and the SFT run,
    which records no tokens, says so in the step browser."""
    browser = chromium()
    page = write_report([demo_run / "grpo", demo_run / "sft"], tmp_path / "both.html")
    browser.open(page.resolve().as_uri())
    assert browser.evaluate("document.getElementById('run').options.length") == 2
    dashed = browser.evaluate("[...document.querySelectorAll('#charts polyline')]"
                              ".map(p => p.getAttribute('stroke-dasharray'))")
    assert "" in dashed and "6 3" in dashed  # the second run is drawn dashed on the same charts
    _select(browser, "run", "1")
    assert "No per-token records" in browser.evaluate("document.getElementById('groups').textContent")
    assert browser.errors == []


def test_tool_calls_and_observations_are_set_apart(tmp_path, chromium):
    """A GRPO run with the calculator tool (a tiny model taught to call it): each observation is one
    boxed block of uncoloured tokens, and the model's call before it is marked."""
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo
    from grpolab.models import load_model_and_tokenizer
    from tests.helpers.tool_models import ENV, tool_questions, tool_using_model

    model, tok = load_model_and_tokenizer(str(tool_using_model(tmp_path)))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(q) + "\n" for q in tool_questions()))
    cfg = GRPOConfig(task=None, train_data=str(tmp_path / "train.jsonl"), prompt_template="compact", env=ENV,
                     n_grpo_steps=1, rollout_batch_size=16, group_size=4, train_batch_size=16,
                     gradient_accumulation_steps=2, sampling_max_tokens=40, sampling_min_tokens=0,
                     sampling_temperature=1.5, eval_examples=1, run_dir=str(tmp_path / "grpo"), show_progress=False,
                     device="cpu")
    train_grpo(cfg, model=model, tokenizer=tok)
    groups = _records(tmp_path / "grpo")[0]
    responses = [r for g in groups for r in g["responses"]]
    blocks = sum(sum(1 for i, o in enumerate(r["obs"]) if o and (i == 0 or not r["obs"][i - 1])) for r in responses)
    assert blocks > 0  # the model called the tool
    browser = chromium()
    browser.open(write_report([tmp_path / "grpo"]).resolve().as_uri())
    assert browser.evaluate("document.querySelectorAll('#groups .obs-block').length") == blocks
    assert browser.evaluate("document.querySelectorAll('#groups .obs-block .tok').length") == sum(
        sum(r["obs"]) for r in responses)
    assert browser.evaluate("[...document.querySelectorAll('#groups .obs-block .tok')]"
                            ".every(e => !e.style.backgroundColor)")
    calls = browser.evaluate("[...document.querySelectorAll('#groups .tok.call')].map(e => e.textContent).join('')")
    assert "<calculate>" in calls
    assert browser.errors == []


def test_a_step_with_many_groups_is_drawn_a_page_at_a_time(tmp_path, chromium):
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo

    cfg = GRPOConfig(n_grpo_steps=1, rollout_batch_size=48, group_size=4, train_batch_size=48,
                     gradient_accumulation_steps=2, sampling_max_tokens=6, sampling_min_tokens=1, eval_examples=1,
                     token_record_groups=12, run_dir=str(tmp_path / "run"), show_progress=False, device="cpu",
                     task_train_size=50)
    train_grpo(cfg)
    assert len(_records(tmp_path / "run")[0]) == 12
    browser = chromium()
    browser.open(write_report([tmp_path / "run"]).resolve().as_uri())
    assert browser.evaluate("document.querySelectorAll('#groups .group').length") == 8
    browser.evaluate("document.getElementById('more').click()")
    assert browser.evaluate("document.querySelectorAll('#groups .group').length") == 12
    assert browser.evaluate("document.getElementById('more')") is None
    assert browser.errors == []
