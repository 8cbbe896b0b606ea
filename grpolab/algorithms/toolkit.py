"""The training-loop toolkit every method shares: seeding, optimizer and schedule, micro-batch
planning, the optimizer step, metrics files, atomic checkpoints, run directories, progress bars."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ..data import load_examples, load_template
from ..data.tasks import get_task
from ..models import load_model_and_tokenizer, save_model_and_tokenizer
from ..rewards import build_reward

# ---------------------------------------------------------------- seeding and precision


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, torch (and numpy when present) in one place; optionally deterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def autocast_for(dtype: str, device: torch.device | str):
    """bf16 autocast (weights stay fp32) where asked, else a no-op context."""
    if dtype == "bfloat16":
        device_type = torch.device(device).type
        return lambda: torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext


# ---------------------------------------------------------------- device and inputs


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def data_options(cfg) -> dict:
    """The data-file settings of a config, as ``load_examples`` keywords."""
    return {"format": cfg.data_format, "question_field": cfg.question_field, "answer_field": cfg.answer_field,
            "on_error": cfg.data_on_error}


def load_inputs(cfg) -> tuple[list, list, Any, Any]:
    """(train examples, eval examples, prompt template, reward fn) from a config with the shared
    data fields (``task``/``train_data``, ``eval_data``, ``prompt_template``, ``reward``)."""
    if cfg.task is not None:
        task = get_task(cfg.task, seed=cfg.seed, **cfg.task_options)
        train = task.examples("train", cfg.task_train_size)
        evals = load_examples(cfg.eval_data, **data_options(cfg)) if cfg.eval_data else task.examples("validation", cfg.eval_examples)
        template = load_template(cfg.prompt_template or task.default_template)
        reward = build_reward(cfg.reward) if cfg.reward is not None else task.reward_fn
    else:
        train = load_examples(cfg.train_data, **data_options(cfg))
        evals = load_examples(cfg.eval_data, **data_options(cfg)) if cfg.eval_data else []
        template = load_template(cfg.prompt_template or "r1_zero")
        reward = build_reward(cfg.reward if cfg.reward is not None else "r1_zero")
    return list(train), list(evals)[: cfg.eval_examples], template, reward


# ---------------------------------------------------------------- optimizer and schedule


def make_optimizer(model, learning_rate: float, betas=(0.9, 0.95), weight_decay: float = 0.0, eps: float = 1e-8):
    """AdamW (CS336 defaults: betas (0.9, 0.95), weight decay 0)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=learning_rate, betas=tuple(betas), weight_decay=weight_decay, eps=eps)


def effective_warmup(warmup_steps: int, total_steps: int) -> int:
    """Warm-up never takes more than 10 % of a run (the seed design's rule for short runs)."""
    return max(0, min(warmup_steps, int(0.1 * total_steps)))


def make_scheduler(optimizer, warmup_steps: int, total_steps: int, kind: str = "constant", min_lr_ratio: float = 0.0):
    """Linear warm-up over ``warmup_steps`` optimizer steps, then constant or cosine decay."""
    if kind not in ("constant", "cosine"):
        raise ValueError(f"unknown lr_schedule {kind!r}; expected constant or cosine")

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_step(model, optimizer, scheduler, max_grad_norm: float | None) -> float:
    """Clip, step, zero. Parameters that got no gradient (every row skipped) get zeros, so AdamW's
    moments move exactly as if the zero gradient had been computed."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if max_grad_norm:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


# ---------------------------------------------------------------- micro-batches


def plan_microbatches(
    lengths: list[int], gradient_accumulation_steps: int, token_budget: int | None = None
) -> list[list[int]]:
    """Split row indices into micro-batches.

    Without a budget: ``gradient_accumulation_steps`` equal consecutive slices (CS336). With a
    ``token_budget``: rows sorted by length and packed so each micro-batch's padded size
    (rows x longest row) stays within the budget — less padding, fewer passes. The losses must
    then be scaled by the global batch size (``global_batch_size=``), which keeps the gradient
    equal to the fixed-micro-batch gradient.
    """
    n = len(lengths)
    if token_budget is None:
        size = n // gradient_accumulation_steps
        return [list(range(i * size, (i + 1) * size)) for i in range(gradient_accumulation_steps)]
    order = sorted(range(n), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max([lengths[j] for j in current] + [lengths[i]])
        if current and longest * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def take_rows(batch: dict[str, torch.Tensor], rows: list[int], device) -> dict[str, torch.Tensor]:
    """Select rows of right-padded (B, T) tensors and trim the common padding on the right."""
    index = torch.tensor(rows, dtype=torch.long)
    mask = batch["response_mask"][index]
    # the last position any selected row uses: its last response token
    used = mask.any(0).nonzero()
    width = int(used.max()) + 1 if len(used) else 1
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == mask.shape[1]:
            out[k] = v[index, :width].to(device)
        elif isinstance(v, torch.Tensor):
            out[k] = v[index].to(device)
    return out


# ---------------------------------------------------------------- run directory, metrics, progress


class RunDir:
    """A run directory: ``config.yaml``, ``metrics.jsonl``, ``samples/``, ``checkpoints/``, ``final/``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "samples").mkdir(exist_ok=True)
        self.checkpoints = self.path / "checkpoints"
        self.metrics_path = self.path / "metrics.jsonl"
        self.final = self.path / "final"

    def write_config(self, config: dict) -> None:
        import yaml

        atomic_write_text(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsLogger:
    """Appends one JSON object per record to ``metrics.jsonl``; mirrors to TensorBoard and W&B when
    asked for and installed (``report_to``)."""

    def __init__(self, path: Path, report_to: Iterable[str] = (), run_name: str | None = None, config: dict | None = None):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        self._wandb = None
        for target in report_to:
            if target == "tensorboard":
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))
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

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_grpo_run(metrics_path: Path, out: Path, title: str = "GRPO") -> Path:
    """A PNG of rollout reward and validation accuracy per GRPO step, from ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if "train/reward" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["grpo_step"] for r in train], [r["train/reward"] for r in train], label="train reward (rollouts)", alpha=0.6)
    ax.plot([r["grpo_step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="validation accuracy")
    ax.set_xlabel("GRPO step")
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


# ---------------------------------------------------------------- checkpoints


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Atomic checkpoints ``checkpoints/step_N/``: model + tokenizer (safetensors) and
    ``trainer_state.pt`` (optimizer, scheduler, KL controller, RNG states, data position, step,
    config). Written to a temporary directory, fsynced, then renamed, so a crash never leaves a
    half-written ``step_N``; only the last ``keep_last`` are kept."""

    STATE_FILE = "trainer_state.pt"

    def __init__(self, root: Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, model, tokenizer, state: dict) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp_step_{step}_", dir=self.root))
        try:
            save_model_and_tokenizer(model, tokenizer, tmp)
            torch.save(state, tmp / self.STATE_FILE)
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_tree(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in self.all()[: -self.keep_last] if self.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def all(self) -> list[Path]:
        if not self.root.exists():
            return []
        done = [p for p in self.root.glob("step_*") if (p / self.STATE_FILE).exists()]
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1] if found else None

    @classmethod
    def load_state(cls, path: Path) -> dict:
        return torch.load(Path(path) / cls.STATE_FILE, weights_only=True)


def rng_state(generators: dict[str, torch.Generator]) -> dict:
    return {"torch": torch.get_rng_state(), **{k: g.get_state() for k, g in generators.items()}}


def restore_rng(state: dict, generators: dict[str, torch.Generator]) -> None:
    torch.set_rng_state(state["torch"])
    for k, g in generators.items():
        g.set_state(state[k])


class ExampleSampler:
    """Seeded pass-by-pass shuffling of a dataset, with a resumable position."""

    def __init__(self, n: int, seed: int):
        if n == 0:
            raise ValueError("the training set is empty")
        self.n, self.seed = n, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            take = min(k - len(out), self.n - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()


# ---------------------------------------------------------------- starting and ending a run


@dataclass
class TrainResult:
    """What every trainer returns: where the run is, and the validation figures before/after."""

    run_dir: Path
    final_dir: Path
    metrics_path: Path
    after: dict[str, float]
    wall_s: float
    before: dict[str, float] | None = None
    n_examples: int | None = None  # SFT: training pairs after filtering
    filtered_sizes: list[int] = field(default_factory=list)  # expert iteration: kept responses per step



def start_run(cfg, resume: bool = False, model=None, tokenizer=None):
    """Everything a trainer does before its loop: the run directory and checkpoint manager, seeding,
    the device, and the model — from the newest checkpoint when resuming, else the one given, else
    ``cfg.model``. A fresh run writes ``config.yaml`` and starts ``metrics.jsonl`` empty.
    Returns ``(run, checkpoints, resume_from, device, model, tokenizer)``."""
    run = RunDir(cfg.run_dir)
    ckpts = CheckpointManager(run.checkpoints, getattr(cfg, "keep_last", 2))
    resume_from = ckpts.latest() if resume else None
    if resume and resume_from is None:
        raise ValueError(f"{run.path}: nothing to resume (no complete checkpoint in {run.checkpoints})")
    seed_everything(cfg.seed, getattr(cfg, "deterministic", False))
    device = resolve_device(cfg.device)
    if resume_from is not None:
        model, tokenizer = load_model_and_tokenizer(str(resume_from))
    elif model is None:
        model, tokenizer = load_model_and_tokenizer(cfg.model, seed=cfg.seed)
    model.to(device).train()
    if resume_from is None:
        run.write_config(cfg.to_dict())
        run.metrics_path.write_text("")
    return run, ckpts, resume_from, device, model, tokenizer
