"""A broken teacher is refused before anything of the run is touched (reliability probe, turn 5:
D06, D08, D10): a teacher whose weights hold NaN, put in place of a finished run's teacher, used to
cut the run's ``metrics.jsonl`` back to its checkpoint before the first step found it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from grpolab.algorithms.distill import train_distill
from grpolab.models import load_model_and_tokenizer, save_model_and_tokenizer
from tests.algorithms.test_distill import ROOT, cli, config, one_line


def test_D10_resume_with_a_broken_teacher_in_place_leaves_the_metrics_whole(tmp_path):
    teacher, tok = load_model_and_tokenizer("embedded:tiny", seed=3)
    save_model_and_tokenizer(teacher, tok, tmp_path / "teacher")
    cfg = config(tmp_path, teacher=str(tmp_path / "teacher"), run_dir=str(tmp_path / "run"), checkpoint_every=1,
                 model="embedded:tiny")
    train_distill(cfg)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert metrics.count("\n") >= 3
    with torch.no_grad():
        teacher.model.layers[0].input_layernorm.weight.fill_(float("nan"))
    shutil.rmtree(tmp_path / "teacher")
    save_model_and_tokenizer(teacher, tok, tmp_path / "teacher")  # the same path, now broken
    proc = subprocess.run([sys.executable, "-m", "grpolab", "distill", "--resume", str(tmp_path / "run"),
                           "--n-distill-steps", "3"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    one_line(proc, f"teacher {tmp_path / 'teacher'}", "input_layernorm.weight holds NaN or inf")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # the final validation record kept


def test_D08_a_nan_teacher_with_a_full_vocabulary_divergence_is_one_line(tmp_path):
    """Before: every step skipped, exit 0, the teacher never named."""
    teacher, tok = load_model_and_tokenizer("embedded:tiny", seed=3)
    with torch.no_grad():
        teacher.lm_head.weight[0, 0] = float("inf")
    save_model_and_tokenizer(teacher, tok, tmp_path / "teacher")
    one_line(cli(tmp_path, "--teacher", tmp_path / "teacher", "--divergence", "forward_kl"), "teacher",
             "holds NaN or inf")
    assert not (tmp_path / "run").exists()


def test_D06_a_run_directory_as_teacher_names_the_teacher_and_its_model(tmp_path):
    """Before: ``no config.json in DIR: not a Hugging Face model directory`` (not said to be the teacher)."""
    teacher, tok = load_model_and_tokenizer("embedded:tiny", seed=3)
    save_model_and_tokenizer(teacher, tok, tmp_path / "a_run" / "final")
    one_line(cli(tmp_path, "--teacher", tmp_path / "a_run"), f"teacher {tmp_path / 'a_run'}",
             f"--teacher {tmp_path / 'a_run' / 'final'}")
