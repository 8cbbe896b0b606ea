"""Metrics: ``metrics.jsonl`` (one JSON object per record, mirrored to TensorBoard/W&B when
asked), reading it back, the reward/accuracy plot, and progress bars."""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Iterable

import torch

from .run_dir import TENSORBOARD_DIR, WANDB_ID_FILE

TRACKERS = ("tensorboard", "wandb", "trackio")


def tracker_names(record: dict[str, Any]) -> tuple[str | None, dict[str, float]]:
    """A record's step key (``train_step``, else ``eval_step``) and its numbers under the names a tracker
    shows: a validation record's figures all under ``eval/`` (its ``time/elapsed_s`` as
    ``eval/time/elapsed_s``, its outer step as ``eval/grpo_step``), so that no name is drawn against two
    step counters."""
    step_key = "train_step" if "train_step" in record else "eval_step" if "eval_step" in record else None
    numeric = {k: (float(v) if isinstance(v, bool) else v) for k, v in record.items() if isinstance(v, (int, float))}
    if step_key == "eval_step":
        numeric = {(k if k.startswith("eval/") or k == step_key else f"eval/{k}"): v for k, v in numeric.items()}
    return step_key, numeric


def tracker_identity(run_name: str | None, config: dict | None) -> tuple[str, str | None, str | None]:
    """(project, entity, run name) for W&B and trackio: the config's ``tracker_project``,
    ``tracker_entity``, ``tracker_run_name``, else ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_NAME``, else
    ``grpolab``, no entity (the account's default), the run directory's name."""
    config = config or {}
    project = config.get("tracker_project") or os.environ.get("WANDB_PROJECT") or "grpolab"
    entity = config.get("tracker_entity") or os.environ.get("WANDB_ENTITY") or None
    name = config.get("tracker_run_name") or os.environ.get("WANDB_NAME") or run_name
    return project, entity, name


class MetricsLogger:
    """Appends one JSON object per record to ``metrics.jsonl``; mirrors to TensorBoard, W&B and trackio
    when asked for and installed (``report_to``). ``offset()`` is the file's length after the last
    record: a checkpoint stores it so a resumed run can drop the records written after it.

    Every point reaches a tracker: training records are drawn against ``train_step`` and validation
    records (``tracker_names``: all under ``eval/``) against ``eval_step``, each a counter that only
    grows within its family. W&B gets them as ``define_metric`` step metrics and its own step is left
    to count records (``wandb.log(..., step=)`` with two counters dropped every validation logged
    after a later training step); a resumed run continues the same W&B run (its id in
    ``wandb_run_id`` beside ``metrics.jsonl``)."""

    def __init__(self, path: Path, report_to: Iterable[str] = (), run_name: str | None = None,
                 config: dict | None = None, truncate_at: int | None = None):
        self.path = Path(path)
        report_to = [report_to] if isinstance(report_to, str) else list(report_to)
        unknown = next((t for t in report_to if t not in TRACKERS), None)
        if unknown is not None:
            raise ValueError(f"unknown report_to target {unknown!r}; expected one of {', '.join(TRACKERS)}")
        if truncate_at is not None and self.path.exists() and self.path.stat().st_size > truncate_at:
            with open(self.path, "r+b") as f:
                f.truncate(truncate_at)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        self._wandb = None
        self._trackio = None
        self._defined: set[str] = set()
        project, entity, name = tracker_identity(run_name, config)
        for target in report_to:
            if target == "tensorboard":
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(self.path.parent / TENSORBOARD_DIR))
                except ImportError:
                    _missing("tensorboard")
            elif target == "wandb":
                try:
                    import wandb
                except ImportError:
                    _missing("wandb")
                    continue
                id_file = self.path.parent / WANDB_ID_FILE
                run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
                id_file.write_text(run_id + "\n")
                self._wandb = wandb.init(project=project, entity=entity, name=name, config=config or {}, id=run_id,
                                         resume="allow", dir=str(self.path.parent))
                for step_key in ("train_step", "eval_step"):
                    self._wandb.define_metric(step_key)
            elif target == "trackio":
                try:
                    import trackio
                except ImportError:
                    _missing("trackio")
                    continue
                self._trackio = trackio.init(project=project, name=name, config=config or {}, resume="allow",
                                             embed=False)

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        step_key, numeric = tracker_names(clean)
        step = clean.get(step_key) if step_key else None
        values = {k: v for k, v in numeric.items() if k != step_key}
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            for k in values.keys() - self._defined:  # each name against its family's counter, once
                self._wandb.define_metric(k, step_metric=step_key) if step_key else None
                self._defined.add(k)
            self._wandb.log(numeric)  # the step key is a value here; W&B's own step counts records
        if self._trackio is not None:
            self._trackio.log(values, step=step)

    def offset(self) -> int:
        self._file.flush()
        return self._file.tell()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._trackio is not None:
            self._trackio.finish()
            self._trackio = None


def _missing(package: str) -> None:
    print(f"grpolab: {package} is not installed (pip install -e '.[track]'); metrics go to metrics.jsonl only",
          file=sys.stderr)


def read_metrics(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_reward_curves(metrics_path: Path, out: Path, title: str, step_key: str) -> Path:
    """A PNG of rollout reward (``train/reward``) and validation accuracy (``eval/accuracy``) per outer
    step (``step_key``: the run's, e.g. ``grpo_step``), from ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if "train/reward" in r and step_key in r]
    evals = [r for r in records if "eval/accuracy" in r and step_key in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [r[step_key] for r in train], [r["train/reward"] for r in train], label="train reward (rollouts)", alpha=0.6
    )
    ax.plot([r[step_key] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="validation accuracy")
    ax.set_xlabel(step_key.replace("_", " "))
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, initial=initial, dynamic_ncols=True, leave=True)
