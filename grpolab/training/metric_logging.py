"""Metrics: ``metrics.jsonl`` (one JSON object per record, mirrored to TensorBoard/W&B when
asked), reading it back, the reward/accuracy plot, and progress bars."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable

import torch

from .run_dir import TENSORBOARD_DIR


class MetricsLogger:
    """Appends one JSON object per record to ``metrics.jsonl``; mirrors to TensorBoard and W&B when
    asked for and installed (``report_to``). ``offset()`` is the file's length after the last
    record: a checkpoint stores it so a resumed run can drop the records written after it."""

    def __init__(self, path: Path, report_to: Iterable[str] = (), run_name: str | None = None,
                 config: dict | None = None, truncate_at: int | None = None):
        self.path = Path(path)
        if truncate_at is not None and self.path.exists() and self.path.stat().st_size > truncate_at:
            with open(self.path, "r+b") as f:
                f.truncate(truncate_at)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        self._wandb = None
        for target in report_to:
            if target == "tensorboard":
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(self.path.parent / TENSORBOARD_DIR))
                except ImportError:
                    print("grpolab: tensorboard is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
            elif target == "wandb":
                try:
                    import wandb

                    self._wandb = wandb.init(project="grpolab", name=run_name, config=config or {})
                except ImportError:
                    print("grpolab: wandb is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
            else:
                raise ValueError(f"unknown report_to target {target!r}; expected tensorboard or wandb")

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        step_key = "train_step" if "train_step" in clean else "eval_step" if "eval_step" in clean else None
        step = clean.get(step_key) if step_key else None
        numeric = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and k != step_key}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

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
