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
  after the same number of samples in every setting), its mean over ``--seeds`` (every setting runs
  every seed, so the accuracies compare at equal samples and seeds);
- the **overlap efficiency**: the median step time over the slower phase's median time measured
  alone with the same threads (1.0: the asynchronous step is as short as its slower phase, perfect
  overlap; 2.0: no overlap at all when the phases are equal). The phases alone come from synchronous
  runs, where generation and update do not overlap: ``phase1`` (``threads`` 1) gives the sampler's
  generation of a step's rollouts (``time/rollout_s``) and the trainer's update (``time/train_s``) on
  one thread, ``sync`` (``threads`` 2) the same on two. Each setting reads the figures of its own
  sampler and trainer threads (``PHASE_THREADS``); ``server1``'s sampler is a vLLM server whose
  generation alone is not measured here, so it has none.

Usage: python benchmarks/async.py [--steps 8] [--warmup 1] [--rounds 1] [--settings sync,async1,async2]
       [--seeds 0,1] [--model DIR]
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
    # the phases alone on one thread each (synchronous: generation, then the update, never both at once)
    "phase1": ["--threads", "1"],
}
# setting -> (the sampler's threads, the trainer's threads): whose phases-alone figures it is measured against
PHASE_THREADS = {"sync": (2, 2), "async1": (1, 1), "async2": (1, 1), "async1-s2": (2, 1)}
# the synchronous setting whose rollout_s / train_s are a phase alone on that many threads
PHASE_RUN = {1: "phase1", 2: "sync"}


def overlap_efficiency(step_s: float, sampler_alone_s: float, trainer_alone_s: float) -> float:
    """The step's time over the slower phase's time alone: 1.0 is perfect overlap, the phases' sum over
    the slower one is none (e.g. 2.0 for equal phases)."""
    return step_s / max(sampler_alone_s, trainer_alone_s)


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
        "step_s": statistics.median(walls),
        "rollout_s": statistics.median(r["time/rollout_s"] for r in counted),
        "train_s": statistics.median(r["time/train_s"] for r in counted),
        "trainer_idle": sum(r.get("time/trainer_wait_s", r.get("time/rollout_s", 0.0)) for r in counted) / sum(walls),
        "sampler_idle": sum(r.get("time/sampler_wait_s", r.get("time/train_s", 0.0)) for r in counted) / sum(walls),
        "staleness": statistics.mean(r.get("async/staleness_mean", 0.0) for r in counted),
        "accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "train_reward": statistics.mean(r["train/reward"] for r in counted),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="counted steps per run (e.g. 3 for a run of a few minutes)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--settings", default="sync,async1,async2")
    p.add_argument("--seeds", default="0,1", help="seeds every setting runs (accuracy at equal samples per seed)")
    p.add_argument("--model", default=str(Path(os.environ.get("GRPOLAB_CACHE", Path.home() / ".cache" / "grpolab"))
                                          / "SmolLM2-135M-Instruct"))
    args = p.parse_args()
    if not Path(args.model, "config.json").is_file():
        raise SystemExit(f"{args.model}: no model there; make real-model builds it")
    settings = args.settings.split(",")
    for s in settings:
        if s not in SETTINGS:
            raise SystemExit(f"--settings: unknown setting {s!r} (one of {', '.join(SETTINGS)})")
    # the synchronous runs that time each phase alone on the threads the chosen settings use
    needed = {PHASE_RUN[n] for s in settings for n in PHASE_THREADS.get(s, ())}
    runs = settings + sorted(needed - set(settings))
    seeds = [int(x) for x in args.seeds.split(",")]
    results: dict[str, list[dict]] = {s: [] for s in runs}
    accuracy: dict[str, dict[int, float]] = {s: {} for s in runs}
    for r in range(args.rounds):
        for seed in seeds:
            for s in runs:
                results[s].append(run_one(s, args, seed))
                accuracy[s].setdefault(seed, results[s][-1]["accuracy"])
                print(f"round {r} seed {seed} {s}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[s][-1].items()
                                                                 if isinstance(v, float)), flush=True)
    table = {s: {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "accuracy"}
             for s, rs in results.items()}
    for s, t in table.items():
        accs = [a for a in accuracy[s].values() if a is not None]
        t["accuracy"] = statistics.mean(accs) if accs else None
        t["accuracy_per_seed"] = accuracy[s]
        if s in PHASE_THREADS:
            sampler_n, trainer_n = PHASE_THREADS[s]
            t["sampler_alone_s"] = table[PHASE_RUN[sampler_n]]["rollout_s"]
            t["trainer_alone_s"] = table[PHASE_RUN[trainer_n]]["train_s"]
            t["overlap_efficiency"] = overlap_efficiency(t["step_s"], t["sampler_alone_s"], t["trainer_alone_s"])
    base = table.get("sync", {}).get("completions_per_s")
    nan = float("nan")
    print(f"\n{'setting':10} {'compl/s':>8} {'x sync':>7} {'step s':>7} {'sampler alone':>13} {'trainer alone':>13} "
          f"{'efficiency':>10} {'trainer idle':>12} {'sampler idle':>12} {'staleness':>9} {'accuracy':>9}  per seed")
    for s, t in table.items():
        ratio = t["completions_per_s"] / base if base else nan
        acc = t["accuracy"] if t["accuracy"] is not None else nan
        print(f"{s:10} {t['completions_per_s']:8.3f} {ratio:7.2f} {t['step_s']:7.2f} "
              f"{t.get('sampler_alone_s', nan):13.2f} {t.get('trainer_alone_s', nan):13.2f} "
              f"{t.get('overlap_efficiency', nan):10.2f} {t['trainer_idle']:12.2f} {t['sampler_idle']:12.2f} "
              f"{t['staleness']:9.2f} {acc:9.3f}  {t['accuracy_per_seed']}")
    print(json.dumps({"table": table, "seeds": seeds, "steps": args.steps, "warmup": args.warmup,
                      "rounds": args.rounds, "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
