"""Asynchronous GRPO against synchronous on a real model (prints figures; not a test).

The work: the real-model arithmetic config (configs/real/smollm2_135m_grpo_arithmetic.yaml:
SmolLM2-135M-Instruct, two-digit addition in words, 32 completions per step, 4 x 8, at most 24
tokens, temperature 0.7), the same steps and seed in every setting. Settings:

- ``sync``: today's loop, ``threads`` 2 (both cores sample, then both train);
- ``async1``, ``async2``: ``max_staleness`` 1 / 2 with the hf sampler process, ``threads`` 1 for
  the trainer and ``sampler_threads`` 1 (one core generates while the other trains);
- ``server1``: ``max_staleness`` 1 with ``rollout_backend: vllm_server`` (needs vLLM: run with
  .venv-vllm's python; left out where vLLM cannot run);
- ``async1-s2``: ``max_staleness`` 1 with ``sampler_threads`` 2 (the sampler has both cores while the
  trainer waits, three threads on two cores while both run).

Each (setting, round) runs as its own ``grpolab grpo`` process; rounds alternate between the
settings (sync, async1, async2, sync, ...) so a change in the machine's load falls on all of them.
The first ``--warmup`` steps are not counted. Figures per setting (medians over rounds):

- completions/s over the counted steps (from the steps' ``time/elapsed_s``) and the ratio to sync;
- the trainer's idle share (``time/trainer_wait_s`` over the step's wall time) and the sampler's
  (``time/sampler_wait_s`` over the same);
- the mean staleness, and the validation accuracy at the end (the config's 50 held-out questions,
  after the same number of samples in every setting); the seed spread of ``sync`` is given by
  ``--seeds`` (each seed one more sync run).

Usage: python benchmarks/async.py [--steps 8] [--warmup 1] [--rounds 1] [--settings sync,async1,async2]
       [--seeds 0] [--model DIR]
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "real" / "smollm2_135m_grpo_arithmetic.yaml"
SETTINGS = {
    "sync": ["--threads", "2"],
    "async1": ["--threads", "1", "--max-staleness", "1", "--sampler-threads", "1"],
    "async2": ["--threads", "1", "--max-staleness", "2", "--sampler-threads", "1"],
    "server1": ["--threads", "1", "--max-staleness", "1", "--rollout-backend", "vllm_server"],
    # the sampler process with both cores' threads: it has the machine while the trainer waits (3 threads on 2 cores)
    "async1-s2": ["--threads", "1", "--max-staleness", "1", "--sampler-threads", "2"],
}


def run_one(setting: str, args, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        argv = [sys.executable, "-m", "grpolab", "grpo", "--config", str(CONFIG), "--model", args.model,
                "--n-grpo-steps", str(args.warmup + args.steps), "--run-dir", str(run_dir), "--seed", str(seed),
                "--show-progress", "false", "--token-record-groups", "0", "--log-generations-samples", "0",
                *SETTINGS[setting]]
        env = {**os.environ, "OMP_NUM_THREADS": "2" if setting == "sync" else "1", "PYTHONPATH": str(ROOT)}
        out = subprocess.run(argv, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{setting} failed:\n{out.stderr[-3000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    counted = steps[args.warmup:]
    start = steps[args.warmup - 1]["time/elapsed_s"] if args.warmup else 0.0
    wall = counted[-1]["time/elapsed_s"] - start
    completions = sum(32 for _ in counted)
    walls = [b["time/elapsed_s"] - a["time/elapsed_s"] for a, b in zip(steps[args.warmup - 1:], counted)] \
        if args.warmup else [wall / len(counted)] * len(counted)
    return {
        "completions_per_s": completions / wall,
        "trainer_idle": sum(r.get("time/trainer_wait_s", r.get("time/rollout_s", 0.0)) for r in counted) / sum(walls),
        "sampler_idle": sum(r.get("time/sampler_wait_s", r.get("time/train_s", 0.0)) for r in counted) / sum(walls),
        "staleness": statistics.mean(r.get("async/staleness_mean", 0.0) for r in counted),
        "accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "train_reward": statistics.mean(r["train/reward"] for r in counted),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--settings", default="sync,async1,async2")
    p.add_argument("--seeds", default="0", help="seeds of the sync runs (the seed spread of accuracy)")
    p.add_argument("--model", default=str(Path(os.environ.get("GRPOLAB_CACHE", Path.home() / ".cache" / "grpolab"))
                                          / "SmolLM2-135M-Instruct"))
    args = p.parse_args()
    if not Path(args.model, "config.json").is_file():
        raise SystemExit(f"{args.model}: no model there; make real-model builds it")
    settings = args.settings.split(",")
    results: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings:
            results[s].append(run_one(s, args, 0))
            print(f"round {r} {s}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[s][-1].items()
                                                 if isinstance(v, float)), flush=True)
    spread = [run_one("sync", args, int(seed))["accuracy"] for seed in args.seeds.split(",")[1:]]
    table = {s: {k: statistics.median(x[k] for x in rs) for k in rs[0] if rs[0][k] is not None}
             for s, rs in results.items()}
    base = table.get("sync", {}).get("completions_per_s")
    print(f"\n{'setting':10} {'compl/s':>8} {'x sync':>7} {'trainer idle':>13} {'sampler idle':>13} "
          f"{'staleness':>9} {'accuracy':>9}")
    for s, t in table.items():
        ratio = t["completions_per_s"] / base if base else float("nan")
        print(f"{s:10} {t['completions_per_s']:8.3f} {ratio:7.2f} {t['trainer_idle']:13.2f} {t['sampler_idle']:13.2f} "
              f"{t['staleness']:9.2f} {t.get('accuracy', float('nan')):9.3f}")
    if spread:
        print(f"sync accuracy over seeds {args.seeds}: {[table['sync'].get('accuracy')] + spread}")
    print(json.dumps({"table": table, "sync_seed_accuracies": spread, "steps": args.steps, "warmup": args.warmup,
                      "rounds": args.rounds, "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
