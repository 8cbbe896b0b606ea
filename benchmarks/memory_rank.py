"""One process of ``benchmarks/memory.py`` (run directly, or by ``torchrun`` once per rank): a short
GRPO run through the trainer API, then this rank's figures written to ``OUT/rank<N>.json``:
the peak RSS (VmHWM) of the whole run, the RSS right after the imports, and the wall and CPU
time of every outer step (``Run.end_step`` to ``Run.end_step``).

Usage: memory_rank.py OUT_DIR --field value ...   (GRPOConfig fields over configs/grpo_tiny.yaml)
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import transformers  # noqa: F401 - the same imports as the idle baseline

import grpolab  # noqa: F401
from grpolab.algorithms.grpo import GRPOConfig, train_grpo
from grpolab.training.config import parse_overrides
from grpolab.training.run import Run

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    """The current resident set (not the peak), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """This process's peak RSS: /proc's VmHWM (Linux). Not ``ru_maxrss``, which keeps the RSS of the
    parent a process was forked from (vfork + exec from a big pytest or launcher inflates it)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    after_imports = {"rss_mb": rss_mb(), "peak_mb": peak_mb()}
    rank = int(os.environ.get("RANK", "0"))
    stamps: list[tuple[float, float]] = []  # (wall, this process's CPU time) at each end_step
    end_step = Run.end_step

    def timed_end_step(self, done, validate=None):
        stamps.append((time.perf_counter(), time.process_time()))
        return end_step(self, done, validate)

    Run.end_step = timed_end_step
    cfg = GRPOConfig.build(ROOT / "configs" / "grpo_tiny.yaml", parse_overrides(args))
    t0 = time.perf_counter()
    train_grpo(cfg)
    wall = time.perf_counter() - t0
    pairs = list(itertools.pairwise(stamps))  # step 0 (warm-up, first gathers) is left out
    record = {"rank": rank, "peak_rss_mb": peak_mb(), "after_imports": after_imports,
              "step_s": [b[0] - a[0] for a, b in pairs], "step_cpu_s": [b[1] - a[1] for a, b in pairs],
              "first_step_end_s": stamps[0][0] - t0 if stamps else None, "wall_s": wall,
              "threads": torch.get_num_threads()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
