"""grpolab.training.metric_logging: metrics.jsonl writing, resume truncation, reading back, the plot."""

import json

import pytest
import torch

from grpolab.training.metric_logging import MetricsLogger, plot_reward_curves, progress, read_metrics


def test_logger_writes_one_json_object_per_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(path)
    logger.log({"train_step": 0, "train/loss": torch.tensor(1.5), "note": "x"})
    logger.log({"eval_step": 0, "eval/accuracy": 0.25})
    logger.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"train_step": 0, "train/loss": 1.5, "note": "x"}, {"eval_step": 0, "eval/accuracy": 0.25}]
    assert read_metrics(path) == [json.loads(line) for line in lines]


def test_offset_is_the_file_length_after_the_last_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(path)
    assert logger.offset() == 0
    logger.log({"train_step": 0})
    assert logger.offset() == path.stat().st_size == len('{"train_step": 0}\n')
    logger.close()


def test_truncate_at_drops_the_records_written_after_the_offset(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(path)
    for step in range(2):
        logger.log({"train_step": step})
    offset = logger.offset()  # what a checkpoint stores
    for step in range(2, 5):
        logger.log({"train_step": step})  # written after the checkpoint, then the run died
    logger.close()
    resumed = MetricsLogger(path, truncate_at=offset)
    assert [r["train_step"] for r in read_metrics(path)] == [0, 1]
    resumed.log({"train_step": 2})
    resumed.close()
    assert [r["train_step"] for r in read_metrics(path)] == [0, 1, 2]


def test_truncate_at_beyond_the_end_changes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"a": 1}\n')
    MetricsLogger(path, truncate_at=10_000).close()
    assert read_metrics(path) == [{"a": 1}]
    MetricsLogger(tmp_path / "new.jsonl", truncate_at=0).close()  # no file yet: created, nothing to cut
    assert (tmp_path / "new.jsonl").read_text() == ""


def test_read_metrics_skips_blank_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"a": 2}\n')
    assert read_metrics(path) == [{"a": 1}, {"a": 2}]


def test_unknown_report_target_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown report_to target 'mlflow'"):
        MetricsLogger(tmp_path / "m.jsonl", report_to=["mlflow"])


def test_plot_reward_curves_draws_reward_and_accuracy(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLoggerContext(path) as logger:
        for step in range(4):
            logger.log({"train_step": step, "grpo_step": step, "train/reward": step / 4})
        logger.log({"eval_step": 0, "grpo_step": 4, "eval/accuracy": 0.5})
    out = plot_reward_curves(path, tmp_path / "curves.png", title="t", step_key="grpo_step")
    assert out == tmp_path / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000


def test_progress_bar_can_be_disabled_and_starts_where_asked():
    bar = progress(10, "GRPO", enabled=False, initial=3)
    assert bar.disable and bar.n == 3 and bar.total == 10
    bar.close()


class MetricsLoggerContext:
    def __init__(self, path):
        self.logger = MetricsLogger(path)

    def __enter__(self):
        return self.logger

    def __exit__(self, *exc):
        self.logger.close()
