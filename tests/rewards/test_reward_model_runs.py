"""A reward model that cannot score is refused before the run directory is touched: ``--overwrite`` of a
finished run keeps it whole, and ``--resume`` does not cut its metrics back, when the reward model's label is
out of range or its weights are damaged (the trainers' input check loads it, and that model scores)."""

from __future__ import annotations

import json
import os

import pytest

from grpolab.algorithms.grpo import train_grpo
from tests.rewards.model_dirs import reward_model_dir


def _files(run_dir) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_size for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture
def finished(grpo_config, tmp_path, monkeypatch):
    """A finished 1-step GRPO run on a reward model (a copy of it at ``rm``); counts the reward-model loads."""
    import grpolab.models.classifier as classifier

    rm = reward_model_dir(tmp_path / "rm")
    loads, real = [], classifier.load_sequence_classifier
    monkeypatch.setattr(classifier, "load_sequence_classifier", lambda *a, **k: loads.append(a) or real(*a, **k))
    small = dict(n_grpo_steps=1, rollout_batch_size=8, train_batch_size=8, gradient_accumulation_steps=1,
                 eval_examples=2, checkpoint_every=1, sampling_max_tokens=4, log_generations_samples=0)
    result = train_grpo(grpo_config(reward={"model": str(rm)}, **small))
    return {"rm": rm, "run": result.run_dir, "loads": loads, "small": small}


def test_a_bad_label_under_overwrite_leaves_the_finished_run_whole(finished, grpo_config):
    assert len(finished["loads"]) == 1  # the check loaded it; training and validation scored with that one
    before = _files(finished["run"])
    with pytest.raises(ValueError, match=r"label 5 out of range \(it has 1\)"):
        train_grpo(grpo_config(reward={"model": str(finished["rm"]), "label": 5}, **finished["small"]),
                   overwrite=True)
    assert _files(finished["run"]) == before


def test_damaged_weights_under_resume_leave_the_metrics_as_they_were(finished, grpo_config):
    metrics = (finished["run"] / "metrics.jsonl").read_text()
    os.truncate(finished["rm"] / "model.safetensors", 100_000)
    cfg = grpo_config(reward={"model": str(finished["rm"])}, **{**finished["small"], "n_grpo_steps": 2})
    with pytest.raises(ValueError, match=f"^{finished['rm'] / 'model.safetensors'}: damaged or truncated weights"):
        train_grpo(cfg, resume=True)
    assert (finished["run"] / "metrics.jsonl").read_text() == metrics


def test_without_a_task_validation_moves_no_running_statistics_and_reports_raw_scores(grpo_config, tmp_path,
                                                                                      monkeypatch):
    from grpolab.rewards.reward_model import RunningMeanStd
    from grpolab.training.metric_logging import read_metrics

    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(8)))
    counted, real = [], RunningMeanStd.update
    monkeypatch.setattr(RunningMeanStd, "update", lambda self, n, *a: counted.append(n) or real(self, n, *a))
    cfg = grpo_config(task=None, train_data=str(data), eval_data=str(data), prompt_template="compact",
                      reward={"model": str(reward_model_dir(tmp_path / "rm")), "normalize": "running"}, n_grpo_steps=1,
                      rollout_batch_size=8, train_batch_size=8, gradient_accumulation_steps=1, eval_examples=4,
                      sampling_max_tokens=4, log_generations_samples=0)
    result = train_grpo(cfg)
    assert sum(counted) == 8  # the one rollout batch; not the 2 x 4 validation responses
    evals = [r for r in read_metrics(result.metrics_path) if "eval/reward" in r]
    assert len(evals) == 2 and all("eval/accuracy" not in r for r in evals)  # no verifier: no accuracy
    assert all(r["eval/reward_model/rm"] == r["eval/reward"] and abs(r["eval/reward"]) > 1e-6 for r in evals)
