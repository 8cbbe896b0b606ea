"""Evaluation with reward models: each model's mean raw score under its own name, accuracy (and pass@k,
maj@k, the format rate) from a verifier only; scored unnormalised, so a training scorer's running statistics
stay put and a batch z-score (mean 0) is never the figure. And ``grpolab eval``'s own lines: a bad --k or
--max-tokens before the pre-sampling estimate, the table before a report that cannot be written."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from typer.testing import CliRunner

import grpolab.cli as cli
from grpolab.data.datasets import Example
from grpolab.eval import evaluate
from grpolab.eval.report import evaluate_model, write_atomically
from grpolab.models import load_model_and_tokenizer
from grpolab.rewards import RewardScorer
from grpolab.rollout import Rollout, SamplingParams
from tests.rewards.model_dirs import reward_model_dir

CPU = torch.device("cpu")
VERIFIER = {"fn": "arithmetic", "key": "answer_reward", "weight": 0.0, "name": "verifier"}
RESPONSES = ["x</think> <answer>5</answer>", "no idea"]


class _Template:
    def format(self, question):
        return f"Q: {question}\nA:"


class _Two:
    """Two responses per question: a right answer in the format, and none."""

    def generate(self, prompts, n, sampling):
        return [Rollout(p, text, [1], [2, 3], [0.0, 0.0], "stop", i) for i, p in enumerate(prompts)
                for text in RESPONSES[:n]]


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    return reward_model_dir(tmp_path_factory.mktemp("eval_rm") / "rm")


QUESTIONS = [Example(f"{i}+{5 - i}", "5") for i in range(3)]


@pytest.mark.parametrize("normalize", ["batch", "running"])
def test_validation_through_the_training_scorer_leaves_its_statistics_and_reports_raw_scores(rm, normalize):
    scorer = RewardScorer({"model": str(rm), "normalize": normalize}, device=CPU)
    state = json.dumps(scorer.state_dict())
    m = evaluate(_Two(), QUESTIONS, _Template(), None, SamplingParams(), n=2, scorer=scorer).metrics
    assert json.dumps(scorer.state_dict()) == state  # running: count 0 -> 0, not 0 -> 6
    raw = RewardScorer({"model": str(rm)}, device=CPU).score(RESPONSES * 3, [None] * 6,
                                                            prompts=[f"Q: {e.question}\nA:" for e in QUESTIONS
                                                                     for _ in RESPONSES])
    mean = sum(s["rm"] for s in raw) / 6
    assert abs(mean) > 1e-3 and m["reward_model/rm"] == pytest.approx(mean, abs=1e-6)
    assert m["reward"] == pytest.approx(mean, abs=1e-6)  # not the batch z-score's mean (0)
    assert "accuracy" not in m and "format_rate" not in m  # no verifier: no accuracy


def test_a_reward_model_alone_gives_no_accuracy_pass_or_maj(rm, tiny_lm):
    model, tok = tiny_lm
    m, gens = evaluate_model(model, tok, _Two(), QUESTIONS, _Template(), {"model": str(rm)}, k=2, entropy=False,
                             scorer=RewardScorer({"model": str(rm)}, device=CPU))
    assert "reward_model/rm" in m and "consistency" in m
    assert not {"accuracy", "pass@1", "pass@2", "maj@2", "format_rate", "mean_length_correct"} & set(m)
    assert all("rm" in g for g in gens)


def test_beside_a_verifier_accuracy_and_pass_at_k_are_the_verifiers(rm, tiny_lm):
    model, tok = tiny_lm
    spec = [{"model": str(rm), "weight": 1.0}, VERIFIER]
    m, _ = evaluate_model(model, tok, _Two(), QUESTIONS, _Template(), spec, k=2, entropy=False,
                          scorer=RewardScorer(spec, device=CPU))
    assert m["accuracy"] == 0.5 and m["format_rate"] == 0.5  # one right answer of two, whatever the RM says
    assert m["pass@2"] == 1.0 and m["pass@1"] == 0.5 and m["maj@2"] == 1.0  # "no idea" has no answer to vote
    assert "reward_model/rm" in m


@pytest.fixture(scope="module")
def tiny_lm():
    return load_model_and_tokenizer("embedded:tiny", seed=0)


def _eval(*args):
    return CliRunner().invoke(cli.app, ["eval", "--model", "embedded:tiny", "--data", "task:arithmetic", "--n", "2",
                                        "--max-tokens", "4", "--no-entropy", *args])


def test_grpolab_eval_reports_the_reward_models_score_under_its_name(rm, tmp_path):
    out = _eval("--k", "2", "--reward", f"{{model: {rm}}}", "--out", str(tmp_path))
    assert out.exit_code == 0, out.output
    rows = {line.split()[0] for line in out.output.splitlines() if line.strip()}
    assert "reward_model/rm" in rows and "accuracy" not in rows and "pass@1" not in rows
    assert "no accuracy, pass@k or maj@k: the reward is a reward model's score alone" in out.output
    report = json.loads((tmp_path / "eval.json").read_text())
    assert "reward_model/rm" in report and "accuracy" not in report


@pytest.mark.parametrize("args, line", [
    (["--k", "0"], "--k must be at least 1, got 0"),
    (["--k", "-1"], "--k must be at least 1, got -1"),
    (["--max-tokens", "-3"], "--max-tokens must be at least 1, got -3"),
])
def test_a_bad_k_or_max_tokens_is_one_line_before_the_estimate(monkeypatch, tmp_path, args, line):
    import grpolab.cli.eval as eval_command

    monkeypatch.setattr(eval_command, "_eval_plan", lambda *a, **k: pytest.fail("the estimate ran"))
    out = _eval(*args, "--out", str(tmp_path))
    assert out.exit_code == 2 and f"grpolab: error: {line}" in out.output and "Traceback" not in out.output


def _full_disk(chunks):
    yield next(iter(chunks))
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_report_file_is_written_whole_or_not_at_all(tmp_path):
    target = tmp_path / "generations.jsonl"
    target.write_text("the previous report\n")
    with pytest.raises(ValueError, match=f"^cannot write {target}: No space left on device$"):
        write_atomically(target, _full_disk(["a\n", "b\n"]))
    assert target.read_text() == "the previous report\n" and [p.name for p in tmp_path.iterdir()] == [target.name]


def test_a_full_disk_after_sampling_is_one_line_after_the_table(monkeypatch, tmp_path):
    import grpolab.eval.report as report

    real = report.write_atomically
    monkeypatch.setattr(report, "write_atomically", lambda path, chunks: real(path, _full_disk(chunks)))
    out = _eval("--k", "1", "--out", str(tmp_path))
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert "pass@1" in out.output  # the figures are on screen
    assert f"grpolab: error: cannot write {tmp_path / 'eval.json'}: No space left on device" in out.output
    assert not list(tmp_path.glob(".*.tmp"))
