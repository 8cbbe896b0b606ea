"""Per-token records (tokens.jsonl) of GRPO runs, and the ``grpolab view`` page built from run
directories (the page in a real browser: tests/browser)."""

import json
import math
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from grpolab.algorithms.grpo import train_grpo
from grpolab.training.run_dir import RECORDS_FILE
from grpolab.training.token_records import TokenRecorder
from grpolab.viewer import ViewError, load_run, make_server, render, report
from grpolab.viewer.report import MAX_POINTS, MAX_STEPS, curves


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / RECORDS_FILE).read_text().splitlines()]


def test_grpo_records_groups_with_per_token_figures(grpo_config, tiny_model, weights, same_weights):
    """Off-policy grpo_clip (2 epochs): the trainer's pre-update log-probs are known on every row
    and equal the sampler's (same fp32 forward); ratio and clip flags exist where a row was trained;
    each group's advantages are its normalised rewards. Recording changes nothing in the run."""
    cfg = grpo_config(n_grpo_steps=2, loss_type="grpo_clip", epochs_per_rollout_batch=2, token_record_groups=2,
                      sampling_max_tokens=8)
    model, tok = tiny_model()
    train_grpo(cfg, model=model, tokenizer=tok, overwrite=True)
    records = _records(Path(cfg.run_dir))
    assert [r["step"] for r in records] == [0, 0, 1, 1]
    for group in records:
        assert len(group["responses"]) == cfg.group_size and group["prompt"] and group["answer"] is not None
        rewards = torch.tensor([r["reward"] for r in group["responses"]])
        advantages = torch.tensor([r["advantage"] for r in group["responses"]])
        assert abs(float(advantages.sum())) < 1e-3  # group-normalised: zero-variance groups get 0
        assert (rewards.std() > 0) or bool((advantages == 0).all())
        for r in group["responses"]:
            n = len(r["tokens"])
            assert 1 <= n <= cfg.sampling_max_tokens and r["finish"] in ("stop", "eos", "length")
            plain = "".join(t for t in r["tokens"] if t not in tok.all_special_tokens)
            assert plain.startswith(r["text"])  # each token's text, special tokens shown as themselves
            assert {"reward", "format_reward", "answer_reward"} <= set(r["rewards"])
            for key in ("sampler_lp", "trainer_lp", "entropy", "ratio", "clipped"):
                assert len(r[key]) == n, key
            assert all(s <= 0 and abs(s - t) < 1e-3 for s, t in zip(r["sampler_lp"], r["trainer_lp"]))
            if r["advantage"] != 0:  # trained: every token has the update's figures
                assert all(e is not None and e >= 0 for e in r["entropy"])
                assert all(q is not None and q > 0 for q in r["ratio"]) and set(r["clipped"]) <= {0, 1}
            else:  # skipped by the update (zero gradient): nothing measured, nothing invented
                assert set(r["entropy"]) == {None}

    # the same run without records: the same weights and rewards
    plain = grpo_config(n_grpo_steps=2, loss_type="grpo_clip", epochs_per_rollout_batch=2, token_record_groups=0,
                        sampling_max_tokens=8,
                        run_dir=cfg.run_dir + "_plain")
    model2, tok2 = tiny_model()
    train_grpo(plain, model=model2, tokenizer=tok2, overwrite=True)
    assert same_weights(model, model2)
    assert not (Path(plain.run_dir) / RECORDS_FILE).exists()
    rewards = lambda d: [json.loads(line)["train/reward"] for line in open(f"{d}/metrics.jsonl")
                         if "train/reward" in line]
    assert rewards(cfg.run_dir) == rewards(plain.run_dir)


def test_on_policy_records_trainer_figures_only_where_measured(grpo_config, tiny_model, tmp_path):
    """On-policy with the hf sampler the trainer's log-probs are only known on the rows the update
    forwarded: the others are null, never a made-up 0."""
    cfg = grpo_config(n_grpo_steps=2, token_record_groups=4)
    model, tok = tiny_model()
    train_grpo(cfg, model=model, tokenizer=tok, overwrite=True)
    records = _records(tmp_path / "run")
    assert len(records) == 2 * 4  # every group of the 4 in each step
    for r in (r for g in records for r in g["responses"]):
        measured = [t is not None for t in r["trainer_lp"]]
        assert all(measured) == (r["advantage"] != 0) and len(set(measured)) == 1
        assert set(r["ratio"]) <= {None, 1.0} and set(r["clipped"]) <= {None, 0.0}  # on-policy: ratio 1, no clip


def test_ppo_records_per_token_advantages(tmp_path, small_run):
    """PPO: GAE gives every token its own advantage; the trainer's (pre-update) log-probs are known
    on every row, and every token was trained (ratio and clip flag from its last minibatch)."""
    from grpolab.algorithms.ppo import PPOConfig, train_ppo

    cfg = PPOConfig(**{**small_run, "rollout_batch_size": 8, "group_size": 2, "train_batch_size": 8, "ppo_epochs": 2,
                       "n_ppo_steps": 1, "eval_examples": 1, "log_generations_samples": 0, "token_record_groups": 2,
                       "run_dir": str(tmp_path / "ppo"), "reward": "tests.helpers.reward_fixtures:length_parity"})
    train_ppo(cfg)
    records = _records(tmp_path / "ppo")
    assert len(records) == 2 and all(len(g["responses"]) == 2 for g in records)
    for r in (r for g in records for r in g["responses"]):
        n = len(r["tokens"])
        assert isinstance(r["advantage"], list) and len(r["advantage"]) == n and None not in r["advantage"]
        assert all(abs(s - t) < 1e-3 for s, t in zip(r["sampler_lp"], r["trainer_lp"]))
        assert None not in r["entropy"] and None not in r["ratio"] and set(r["clipped"]) <= {0, 1}


def test_resumed_recorder_keeps_the_steps_before_the_checkpoint(tmp_path):
    lines = [json.dumps({"step": s, "group": 0, "responses": []}) for s in range(4)]
    (tmp_path / RECORDS_FILE).write_text("\n".join(lines) + "\n")
    TokenRecorder(tmp_path, 2, seed=0, resume_step=2)
    assert [r["step"] for r in _records(tmp_path)] == [0, 1]
    TokenRecorder(tmp_path, 0, seed=0, resume_step=1)  # resumed without recording: the later steps go all the same
    assert [r["step"] for r in _records(tmp_path)] == [0]
    TokenRecorder(tmp_path, 2, seed=0)  # a fresh run starts empty
    assert (tmp_path / RECORDS_FILE).read_text() == ""
    TokenRecorder(tmp_path, 0, seed=0)  # ... and one that records nothing leaves no file
    assert not (tmp_path / RECORDS_FILE).exists()
    picks = TokenRecorder(tmp_path, 3, seed=0).pick(16, step=5)
    assert picks == TokenRecorder(tmp_path, 3, seed=0).pick(16, step=5) and len(set(picks)) == 3


def _fake_run(path, steps: int, groups: int = 1, tokens: int = 2):
    path.mkdir()
    (path / "config.yaml").write_text("learning_rate: 0.001\n")
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(steps):
            f.write(json.dumps({"grpo_step": s, "train_step": s, "train/reward": s / steps}) + "\n")
    response = {"reward": 1.0, "rewards": {"reward": 1.0}, "finish": "eos", "text": "a</b>",
                "tokens": ["a", "</b>"] + ["c"] * (tokens - 2), "advantage": 0.5,
                "sampler_lp": [-0.1, -2.0] + [-1.0] * (tokens - 2),
                "trainer_lp": [-0.1, None] + [None] * (tokens - 2)}
    with open(path / RECORDS_FILE, "w") as f:
        for s in range(steps):
            for g in range(groups):
                f.write(json.dumps({"step": s, "group": g, "prompt": "<script>", "responses": [response]}) + "\n")
    return path


def test_page_is_self_contained_and_large_runs_are_sampled(tmp_path, monkeypatch):
    run = _fake_run(tmp_path / "big", steps=3 * MAX_STEPS, groups=2)
    data = load_run(run)
    assert len(data["steps"]) == MAX_STEPS and data["recorded_steps"] == 3 * MAX_STEPS
    assert data["steps"][0]["step"] == 0 and data["steps"][-1]["step"] == 3 * MAX_STEPS - 1
    assert len(data["curves"]["train/reward"]) <= MAX_POINTS
    # long responses: fewer steps, so the page stays about MAX_TOKENS tokens (a small budget here)
    monkeypatch.setattr(report, "MAX_TOKENS", 1000)
    run = _fake_run(tmp_path / "long", steps=50, tokens=100)
    kept = load_run(run)["steps"]
    assert len(kept) == 10 and kept[0]["step"] == 0 and kept[-1]["step"] == 49
    page = render([run])
    assert "http://" not in page and "https://" not in page and " src=" not in page  # nothing fetched at view time
    payload = page.split('<script type="application/json" id="data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(payload)["runs"][0]["steps"][0]["groups"][0]["prompt"] == "<script>"  # "</" escaped, not cut


def test_curves_average_each_step_records():
    records = [{"grpo_step": 0, "x": 1.0}, {"grpo_step": 0, "x": 3.0}, {"grpo_step": 1, "x": float("nan")},
               {"grpo_step": 1, "x": 5.0, "flag": True}]
    assert curves(records, "grpo_step") == {"x": [[0, 2.0], [1, 5.0]]}
    many = [{"s": i, "y": float(i)} for i in range(10 * MAX_POINTS)]
    points = curves(many, "s")["y"]
    assert len(points) <= MAX_POINTS and math.isclose(points[0][1], 4.5)


def test_bad_run_directories_are_one_line_errors(tmp_path):
    with pytest.raises(ViewError, match="no such run directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "parent").mkdir()
    _fake_run(tmp_path / "parent" / "grpo", steps=2)
    with pytest.raises(ViewError, match=r"no metrics.jsonl .*runs inside it: .*parent/grpo"):
        load_run(tmp_path / "parent")
    run = _fake_run(tmp_path / "bad", steps=2)
    (run / RECORDS_FILE).write_text('{"step": 0, "responses": []}\nnot json\n')
    with pytest.raises(ViewError, match=r"tokens.jsonl:2: not JSON"):
        load_run(run)


def test_cli_writes_the_page_and_serves_it_on_localhost(tmp_path):
    from grpolab.cli import app

    run = _fake_run(tmp_path / "run", steps=3)
    result = CliRunner().invoke(app, ["view", str(run), "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    result = CliRunner().invoke(app, ["view", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no such run directory" in result.output
    server = make_server([run], port=0)
    assert server.server_address[0] == "127.0.0.1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert "grpolab view" in urllib.request.urlopen(url + "/", timeout=30).read().decode()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "/config.yaml", timeout=30)
    finally:
        server.shutdown()
        server.server_close()


def test_token_records_write_non_finite_figures_as_null():
    """A reward of 1e39 is inf in float32 (and a reward function may return inf or NaN): the
    record says null, which JSON can spell, rather than Infinity, which strict readers refuse."""
    from types import SimpleNamespace

    from grpolab.models import build_char_tokenizer

    rollout = SimpleNamespace(prompt_ids=[1, 2], response_ids=[3, 4], finish_reason="eos", response="ab",
                              loss_mask=None, info={})
    score = {"reward": float("inf"), "verifier": float("nan"), "format": 1.0}
    out = TokenRecorder._response(rollout, score, 0, build_char_tokenizer(), {}, torch.tensor([float("-inf")]))
    assert out["reward"] is None and out["rewards"] == {"reward": None, "verifier": None, "format": 1.0}
    assert out["advantage"] is None
    json.loads(json.dumps(out, allow_nan=False))
