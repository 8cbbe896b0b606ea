"""W&B (offline), TensorBoard and trackio receive every training and validation point (issue 59), read back
with the real packages' own files."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from grpolab.training.metric_logging import tracker_identity
from tests.helpers.tracker_logs import tensorboard_scalars, wandb_history, wandb_records, wandb_step_metrics

MISSING = [p for p in ("wandb", "tensorboard", "trackio") if importlib.util.find_spec(p) is None]

RUN = textwrap.dedent("""
    import sys
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo
    train_grpo(GRPOConfig(model="embedded:tiny", task="arithmetic", run_dir=sys.argv[1], n_grpo_steps=3, eval_every=1,
                          rollout_batch_size=4, group_size=2, train_batch_size=4, gradient_accumulation_steps=2,
                          epochs_per_rollout_batch=2, sampling_max_tokens=8, eval_examples=2, show_progress=False,
                          device="cpu", threads=1, report_to="wandb", tracker_run_name="named"))
""")


@pytest.mark.skipif(bool(MISSING), reason=f"not installed: {MISSING} (pip install -e '.[track]')")
def test_every_validation_point_reaches_wandb_tensorboard_and_trackio(tmp_path):
    run = tmp_path / "run"
    script = RUN.replace('report_to="wandb"', 'report_to=["wandb", "tensorboard", "trackio"]')
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "fromenv",
           "TRACKIO_DIR": str(tmp_path / "trackio"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script, str(run)], env=env, check=True, capture_output=True, timeout=600)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in lines if "eval_step" in r]
    trains = [r["train/loss"] for r in lines if "train_step" in r]
    assert len(evals) == 4 and len(trains) == 6  # 3 validations during, 1 at the end; 2 updates a step

    records = wandb_records(next(run.glob("wandb/offline-run-*/run-*.wandb")))
    meta = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (meta.project, meta.display_name) == ("fromenv", "named")
    rows = wandb_history(records)
    assert [r["eval/accuracy"] for r in rows if "eval/accuracy" in r] == evals  # none dropped, in order
    assert [r["eval_step"] for r in rows if "eval_step" in r] == [0, 1, 2, 3]
    assert [r["train/loss"] for r in rows if "train/loss" in r] == pytest.approx(trains)
    steps = wandb_step_metrics(records)
    assert steps["eval/accuracy"] == "eval_step" and steps["train/loss"] == "train_step"
    assert steps["eval/time/elapsed_s"] == "eval_step" and steps["time/elapsed_s"] == "train_step"

    assert tensorboard_scalars(run / "tensorboard", "eval/accuracy") == [(i, pytest.approx(v))
                                                                         for i, v in enumerate(evals)]
    assert [s for s, _ in tensorboard_scalars(run / "tensorboard", "train/loss")] == list(range(6))

    check = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
             "print(json.dumps(S.get_logs('fromenv', 'named')))")
    logs = json.loads(subprocess.run([sys.executable, "-c", check], env=env, check=True, capture_output=True,
                                     text=True, timeout=120).stdout)
    assert [r["eval/accuracy"] for r in logs if "eval/accuracy" in r] == pytest.approx(evals)
    assert [r["train/loss"] for r in logs if "train/loss" in r] == pytest.approx(trains)


def test_project_entity_and_name_come_from_fields_then_wandb_variables(monkeypatch):
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    assert tracker_identity("runs/a", {}) == ("grpolab", None, "runs/a")
    monkeypatch.setenv("WANDB_PROJECT", "p")
    monkeypatch.setenv("WANDB_ENTITY", "e")
    monkeypatch.setenv("WANDB_NAME", "n")
    assert tracker_identity("a", {}) == ("p", "e", "n")
    fields = {"tracker_project": "P", "tracker_entity": "E", "tracker_run_name": "N"}
    assert tracker_identity("a", fields) == ("P", "E", "N")
