"""The cost of the viewer's per-token records (``token_record_groups``) on the demo's GRPO run.

Runs the demo's GRPO settings (128 rollouts a step, group 8, Dr. GRPO) from ``--model`` (the
demo's SFT warm start ``runs/demo/sft/final`` after ``grpolab demo``: from the untrained tiny model
every reward is 0 and the update has nothing to train), with ``token_record_groups`` 2 (the
default) and 0 in the order 2, 0, 0, 2 (after one discarded warm-up run), ``--repeats`` times, and
compares the process CPU time of the runs (less sensitive to other processes than the wall clock
on a shared machine; set OMP_NUM_THREADS=1). Also prints the run's own ``time/token_records_s``
(writing tokens.jsonl) over its steps' wall time.

Usage: OMP_NUM_THREADS=1 python benchmarks/token_records.py --model runs/demo/sft/final [--steps 10] [--repeats 1]
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from grpolab.algorithms.grpo import GRPOConfig, train_grpo
from grpolab.experiments.presets import DEMO_GRPO, TASK, TASK_OPTIONS
from grpolab.models import load_model_and_tokenizer
from grpolab.training.metric_logging import read_metrics


def one_run(model_path: str, groups: int, steps: int, root: Path) -> tuple[float, float, float]:
    """(CPU seconds of the run, wall seconds of its steps, seconds writing records)."""
    model, tokenizer = load_model_and_tokenizer(model_path, seed=0)
    cfg = GRPOConfig(**{**DEMO_GRPO, "n_grpo_steps": steps, "eval_every": 0, "eval_examples": 1,
                        "log_generations_samples": 0}, task=TASK, task_options=TASK_OPTIONS, device="cpu",
                     show_progress=False, token_record_groups=groups, run_dir=str(root / f"g{groups}"))
    cpu = time.process_time()
    train_grpo(cfg, model=model, tokenizer=tokenizer, overwrite=True)
    cpu = time.process_time() - cpu
    steps_m = [r for r in read_metrics(root / f"g{groups}" / "metrics.jsonl") if "time/rollout_s" in r]
    wall = sum(r["time/rollout_s"] + r["time/train_s"] + r.get("time/token_records_s", 0.0) for r in steps_m)
    return cpu, wall, sum(r.get("time/token_records_s", 0.0) for r in steps_m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:tiny", help="e.g. runs/demo/sft/final (the demo's warm start)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    figures = {0: [], 2: []}
    with tempfile.TemporaryDirectory() as root:
        one_run(args.model, 0, 2, Path(root))  # warm-up: lazy imports, allocator
        for _ in range(args.repeats):
            for groups in (2, 0, 0, 2):
                figures[groups].append(one_run(args.model, groups, args.steps, Path(root)))
                cpu, wall, rec = figures[groups][-1]
                print(f"token_record_groups {groups}: {cpu:.1f} s CPU, steps {wall:.1f} s wall, "
                      f"records {rec * 1000:.0f} ms")
    cpu_on = sum(f[0] for f in figures[2]) / len(figures[2])
    cpu_off = sum(f[0] for f in figures[0]) / len(figures[0])
    writing = sum(f[2] for f in figures[2]) / sum(f[1] for f in figures[2])
    result = {"model": args.model, "steps": args.steps, "repeats": args.repeats, "cpu_s_records_on": cpu_on,
              "cpu_s_records_off": cpu_off,
              "cpu_overhead_percent": 100 * (cpu_on - cpu_off) / cpu_off, "writing_percent_of_step_wall": 100 * writing}
    print(f"CPU time with records {cpu_on:.1f} s, without {cpu_off:.1f} s: {result['cpu_overhead_percent']:+.2f} %; "
          f"writing tokens.jsonl: {result['writing_percent_of_step_wall']:.2f} % of the steps' wall time")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
