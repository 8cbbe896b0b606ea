"""An environment written against verifiers' current API (``verifiers.v1``: a ``Taskset`` of ``Task``
objects with ``@vf.reward`` methods, the only API of verifiers 0.4) through ``env: {verifiers: FILE}``:
its tasks are the rows, the task's rewards score grpolab's replies over a ``vf.Trace`` (in the reward
workers), a short GRPO run trains with no reward error and ``grpolab eval`` reports its figures.
Runs on whichever verifiers is installed that ships ``verifiers.v1`` (0.3.1 in .venv; 0.4.0 in .venv-vf04)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers with its v1 API is not installed (pip install -e '.[envs]')")

from grpolab.algorithms.grpo import GRPOConfig, train_grpo  # noqa: E402
from grpolab.data.tasks.vf import VerifiersTask  # noqa: E402
from grpolab.rewards.vf_reward import VfRubric  # noqa: E402
from grpolab.training.metric_logging import read_metrics  # noqa: E402
from tests.helpers.chat_models import chat_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SUM_V1 = str(Path(__file__).parent / "vf_envs" / "sum_taskset_v1.py")


def expected(reply: str, answer: str) -> dict[str, float]:
    """The taskset's rewards by its own rule (sum_taskset_v1's docstring), computed here apart."""
    numbers = re.findall(r"-?\d+", reply.strip())
    correct = 1.0 if numbers and numbers[-1] == answer else 0.0
    short = 1.0 if len(reply.strip()) <= 8 else 0.0
    return {"reward": correct + 0.1 * short, "vf/correct": correct, "vf/short": short,
            "vf/length": float(len(reply.strip()))}


def test_a_v1_taskset_is_the_task_and_its_rewards_the_reward():
    task = VerifiersTask(SUM_V1, {"n": 40})
    assert task.kind == "single_turn" and sum(task.size(s) for s in ("train", "validation", "test")) == 40
    example = task.examples("train", 1)[0]
    assert example.question[0] == {"role": "system", "content": "Answer with the number only."}
    assert example.question[1]["role"] == "user" and example.question[1]["content"].startswith("What is ")
    answer = str(sum(int(n) for n in re.findall(r"\d+", example.question[1]["content"])))
    rubric = VfRubric(SUM_V1, {"n": 40})
    for reply in (answer, "8" if answer != "8" else "9", f"the answer is {answer}"):
        assert rubric(reply, example.answer) == pytest.approx(expected(reply, answer))
    with pytest.raises(ValueError, match="do not fit its SumConfig"):
        VerifiersTask(SUM_V1, {"n": "many"})


def test_a_grpo_run_on_a_v1_taskset_trains_and_grpolab_eval_reports_it(tmp_path):
    cfg = GRPOConfig(model=str(chat_model_dir(tmp_path / "m")), env={"verifiers": SUM_V1, "args": {"n": 64}},
                     n_grpo_steps=3, rollout_batch_size=8, group_size=4, train_batch_size=8,
                     gradient_accumulation_steps=2, sampling_max_tokens=4, sampling_min_tokens=1, learning_rate=1e-3,
                     warmup_steps=0, task_train_size=20, eval_examples=4, token_record_groups=2,
                     run_dir=str(tmp_path / "run"), show_progress=False, device="cpu")
    result = train_grpo(cfg)
    steps = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert len(steps) == 3 and all(r["health/reward_errors"] == 0 for r in steps)
    records = [json.loads(line) for line in (Path(cfg.run_dir) / "tokens.jsonl").read_text().splitlines()]
    for step, record in enumerate(steps):
        scored = [(ast.literal_eval(g["answer"]), r) for g in records if g["step"] == step for r in g["responses"]]
        assert scored  # every recorded reply got the task's rewards, computed apart here
        for truth, r in scored:
            content = next(m["content"] for m in truth["row"]["prompt"] if m["role"] == "user")
            answer = str(sum(int(n) for n in re.findall(r"\d+", content)))
            assert r["reward"] == round(expected(r["text"], answer)["reward"], 4)
        assert "train/reward_vf/correct" in record and "train/reward_vf/short" in record
    out = tmp_path / "eval"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "grpolab", "eval", "--model", str(Path(cfg.run_dir) / "final"),
                           "--data", f"vf:{SUM_V1}", "--n", "4", "--k", "1", "--max-tokens", "4", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["n"] == 4 and report["reward_errors"] == 0 and 0 <= report["accuracy"] <= 1
    # accuracy is the answer reward's (correct: the largest weight) share at 1; the reward its weighted sum
    assert report["accuracy"] == report["vf/correct"]
    assert report["reward"] == pytest.approx(report["vf/correct"] + 0.1 * report["vf/short"])
