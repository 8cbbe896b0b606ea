"""Peak memory per rank and step time of GRPO on the embedded ``small`` model (9.5M parameters,
float32, CPU): one process vs DDP vs FSDP2 vs DeepSpeed ZeRO-3 (2 ranks each, ``torchrun
--nproc_per_node 2``, ``gloo``), each with and without LoRA, and one process with gradient
checkpointing — side by side in one run (prints figures; not a test).

Every configuration is a real, separate run of the trainer (``benchmarks/memory_rank.py`` under
``torchrun``, or alone for one process): ``--steps`` GRPO steps of 16 rollouts (4 prompts x group 4)
of up to 16 new tokens, on-policy, no reference model (``kl_coef: 0``), AdamW, reward "the response
has an even length" (varies within most groups, so every step has a gradient). Each rank reports
its own peak RSS (VmHWM: the high-water mark of the process, whole run: model load,
engine set-up, sampling, update, saving ``final/``); the table gives the largest and smallest over
ranks, and the same minus the RSS of an idle process that only imported torch, transformers and
grpolab (measured first), i.e. what training costs. Step time: the median wall time of an outer
step (sampling + update + refreshing the sampler's copy of the weights), the first step left out,
and its CPU time summed over the ranks (``time.process_time``: less sensitive to other load on a
shared machine than wall time; a rank waiting in a collective may spin and count).
One process uses all the cores' threads; 2 ranks use one thread each (``OMP_NUM_THREADS``).

LoRA with DeepSpeed is refused by the config (use DDP or FSDP2) and shown as "refused".

Usage: python benchmarks/memory.py [--steps 6] [--only single,ddp,...] [--lora-r 8] [--model DIR]
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = ROOT / "benchmarks" / "memory_rank.py"
IDLE = ("import sys, torch, transformers, grpolab, grpolab.algorithms.grpo;"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import memory_rank; print(memory_rank.peak_mb())")

# (name, distributed, ranks, extra overrides)
ROWS = [
    ("single", "none", 1, []),
    ("single + grad ckpt", "none", 1, ["--gradient-checkpointing", "true"]),
    ("ddp", "ddp", 2, []),
    ("fsdp2", "fsdp2", 2, []),
    ("zero3", "deepspeed", 2, ["--deepspeed-config", "configs/deepspeed_zero3.json"]),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def idle_baseline_mb() -> float:
    out = subprocess.run([sys.executable, "-c", IDLE], cwd=ROOT, env=_env(1), capture_output=True, text=True,
                         check=True, timeout=120)
    return float(out.stdout.strip().splitlines()[-1])


def overrides(args, strategy: str, lora: bool, extra: list[str], run_dir: Path) -> list[str]:
    out = ["--model", args.model, "--n-grpo-steps", str(args.steps), "--rollout-batch-size", "16",
           "--group-size", "4", "--train-batch-size", "16", "--gradient-accumulation-steps", "2",
           "--sampling-max-tokens", "16", "--learning-rate", "1e-4", "--kl-coef", "0",
           "--reward", "tests.helpers.reward_fixtures:length_parity", "--eval-every", "0", "--eval-examples", "4",
           "--log-generations-samples", "0", "--checkpoint-every", "0", "--show-progress", "false",
           "--task-train-size", "64", "--distributed", strategy, "--run-dir", str(run_dir), *extra]
    if lora:
        out += ["--lora-r", str(args.lora_r), "--lora-alpha", str(2 * args.lora_r)]
    return out


def refusal(strategy: str, extra: list[str], lora_r: int) -> str | None:
    """The config's one-line refusal of this combination, or None."""
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.training.config import ConfigError, parse_overrides

    fields = {"distributed": strategy, "lora_r": lora_r, **parse_overrides(extra)}
    try:
        GRPOConfig.build(ROOT / "configs" / "grpo_tiny.yaml", fields)
    except ConfigError as exc:
        return str(exc)
    return None


def measure(args, name: str, strategy: str, ranks: int, lora: bool, extra: list[str], work: Path) -> dict:
    out = work / f"{name}-{'lora' if lora else 'full'}".replace(" ", "_").replace("+", "")
    run_args = overrides(args, strategy, lora, extra, out / "run")
    threads = max(1, (os.cpu_count() or 1) // ranks)
    if ranks == 1:
        cmd = [sys.executable, str(RANK_SCRIPT), str(out / "ranks"), *run_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(_port()), str(RANK_SCRIPT), str(out / "ranks"), *run_args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(threads), capture_output=True, text=True, timeout=args.timeout,
                          check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"status": "failed", "error": proc.stderr.strip().splitlines()[-1:] or ["?"], "wall_s": wall}
    per_rank = [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in range(ranks)]
    steps = per_rank[0]["step_s"]  # rank 0's clock (ranks step in lock-step)
    cpu = [sum(c) for c in zip(*(r["step_cpu_s"] for r in per_rank))]  # CPU seconds of all ranks per step
    return {"status": "ok", "ranks": ranks, "threads_per_rank": threads,
            "peak_rss_mb": [round(r["peak_rss_mb"], 1) for r in per_rank],
            "rss_after_imports_mb": [round(r["after_imports"]["rss_mb"], 1) for r in per_rank],
            "step_s_median": round(statistics.median(steps), 3) if steps else None,
            "step_s": [round(s, 3) for s in steps],
            "step_cpu_s_median": round(statistics.median(cpu), 3) if cpu else None,
            "step_cpu_s": [round(c, 3) for c in cpu], "process_wall_s": round(wall, 1)}


def table(results: dict, idle: float) -> str:
    lines = [
        "| setting | LoRA | ranks | peak RSS / rank (MB) | minus idle (MB) | step wall (s) | step CPU, all ranks (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        name, lora = key.rsplit("/", 1)
        if r["status"] != "ok":
            what = "refused" if r["status"] == "refused" else "failed"
            lines.append(f"| {name} | {lora} | - | {what} | - | - | - |")
            continue
        peaks = r["peak_rss_mb"]

        def span(values):
            lo, hi = min(values), max(values)
            return f"{hi:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"

        lines.append(f"| {name} | {lora} | {r['ranks']} | {span(peaks)} | {span([p - idle for p in peaks])} | "
                     f"{r['step_s_median']:.2f} | {r['step_cpu_s_median']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--model", default="embedded:small", help="embedded:NAME or a model directory")
    parser.add_argument("--only", default="", help="comma-separated setting names (default: all)")
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    wanted = {s.strip() for s in args.only.split(",") if s.strip()}
    idle = idle_baseline_mb()
    print(f"idle process (import torch, transformers, grpolab): peak RSS {idle:.0f} MB", flush=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="grpolab-memory-") as tmp:
        for name, strategy, ranks, extra in ROWS:
            if wanted and name not in wanted:
                continue
            for lora in (False, True):
                if lora and "grad ckpt" in name:
                    continue  # one extra row: gradient checkpointing on full fine-tuning
                key = f"{name}/{'yes' if lora else 'no'}"
                refused = refusal(strategy, extra, args.lora_r) if lora else None
                if refused:
                    results[key] = {"status": "refused", "error": refused}
                else:
                    results[key] = measure(args, name, strategy, ranks, lora, extra, Path(tmp))
                r = results[key]
                print(f"  {key}: {r['status']} {r.get('peak_rss_mb', r.get('error', ''))} "
                      f"step {r.get('step_s_median')}s (process {r.get('process_wall_s')}s)", flush=True)
    print()
    print(f"GRPO on {args.model}, {args.steps} steps of 16 rollouts x <=16 tokens; "
          f"{platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; idle process {idle:.0f} MB")
    print(table(results, idle))
    print(json.dumps({"idle_rss_mb": round(idle, 1), "steps": args.steps, "lora_r": args.lora_r,
                      "cpus": os.cpu_count(), "torch_threads_single": os.cpu_count(), "results": results}))


if __name__ == "__main__":
    main()
