"""The compiled update (``compile``) against the eager one on a real model (prints figures; not a test).

The update of ``make bench-real`` without its rollout: SmolLM2-135M-Instruct (the cache ``make
test-real`` fills), a batch of ``--rows`` rows (prompt ``--prompt`` tokens, responses of random lengths
in ``--lengths``, drawn anew each step: the lengths a real run sees vary), sorted by length into
micro-batches of ``--micro`` rows, per micro-batch the grpolab forward (``response_log_probs``: the
fused head at the response positions) under the run's autocast, a masked-mean policy-gradient loss,
its backward, then one AdamW step. Each dtype runs in its own subprocess with a fresh inductor cache (a
cold compile, what a new run pays), and there every step is timed twice on the same batch, eager and
compiled (the same model in and out of ``CompiledLayers``' context), in alternating order: on a shared
machine both sides see the same load.

Figures per setting: the mean update seconds over the counted steps (after ``--warmup``; the compiled
side's first step holds the compile), the fraction of the machine's matmul floor (``real_model.py``'s:
6 x matmul parameters x unpadded tokens / seconds / the best F.linear GFLOP/s at the model's shapes,
the higher of before and after), the compile seconds (the first step's extra over a counted step, less
the eager side's), the steps that pay it back, and the graphs dynamo compiled over all the steps'
different lengths.

Usage: python benchmarks/compile.py [--steps 3] [--warmup 1] [--dtypes float32,bfloat16] [--threads N]
       [--rows 16] [--micro 8] [--model DIR] [--device cpu]
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import ROOT, floor_worker, machine_line, matmul_params, sync  # noqa: E402


def default_model() -> str:
    """scripts/real_model.py's cached SmolLM2 (loaded by path: benchmarks/real_model.py has its name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scripts_real_model", ROOT / "scripts" / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path, why = module.status()
    if path is None:
        sys.exit(f"compile.py: SmolLM2-135M-Instruct unavailable: {why} (make real-model fetches it)")
    return str(path)


def worker(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from grpolab.models.compiled import CompiledLayers, graphs_compiled
    from grpolab.models.fused_head import response_log_probs
    from grpolab.training.run_setup import autocast_for, disable_dropout

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).train()
    disable_dropout(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95))
    autocast = autocast_for(args.dtype, args.device)
    compiled = CompiledLayers(model)
    vocab, rng = model.config.vocab_size, random.Random(0)
    lo, hi = (int(x) for x in args.lengths.split(","))
    steps: dict[str, list] = {"eager": [], "compiled": []}
    for step in range(args.warmup + args.steps):
        lengths = sorted(rng.randint(lo, hi) for _ in range(args.rows))
        tokens = sum(args.prompt + n for n in lengths)
        # the compiled side first at the first step (its compile is what is measured), then alternating
        for mode in ("compiled", "eager") if step % 2 == 0 else ("eager", "compiled"):
            context = compiled if mode == "compiled" else contextlib.nullcontext
            torch.manual_seed(step)
            sync(args.device)
            start = time.perf_counter()
            for i in range(0, args.rows, args.micro):
                rows = lengths[i: i + args.micro]
                width = args.prompt + max(rows)
                ids = torch.randint(100, vocab, (len(rows), width + 1), device=args.device)
                mask = torch.zeros(len(rows), width, dtype=torch.bool, device=args.device)
                for r, n in enumerate(rows):
                    mask[r, args.prompt - 1: args.prompt - 1 + n] = True
                advantages = torch.randn(len(rows), 1, device=args.device)
                with autocast(), context():
                    lp = response_log_probs(model, ids[:, :-1], ids[:, 1:], positions=mask)["log_probs"]
                loss = -((lp * advantages * mask).sum(1) / mask.sum(1)).sum() / args.rows
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(args.device)
            steps[mode].append({"update_s": time.perf_counter() - start, "tokens": tokens, "graphs": graphs_compiled()})
            print(f"{args.dtype} {mode} step {step}: {steps[mode][-1]['update_s']:.1f} s", file=sys.stderr, flush=True)
    return {"steps": steps, "threads": torch.get_num_threads()}


def run(args, **extra) -> dict:
    options = {**vars(args), **extra}
    cmd = [sys.executable, __file__, "--worker", json.dumps(options)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold: what a new run pays
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)  # its stderr: the steps as they go
    if out.returncode:
        sys.exit(f"compile.py: worker {extra} failed (its stderr above)")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--lengths", default="16,112", help="response lengths, min,max (drawn per row and step)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--floor-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    if args.worker is not None:
        options = argparse.Namespace(**json.loads(args.worker))
        print(json.dumps(floor_worker(options) if options.kind == "floor" else worker(options)))
        return
    args.model = args.model or default_model()
    params, _ = matmul_params(args.model)
    print(machine_line(args.model, args.device) + f"; {args.threads} thread(s)", flush=True)
    floor_before = run(args, kind="floor")
    results = {}
    for dtype in args.dtypes.split(","):
        both = run(args, kind="update", dtype=dtype)
        for mode in ("eager", "compiled"):
            results[f"{dtype} {mode}"] = {"steps": both["steps"][mode]}
            print(f"{dtype} {mode}: update s per step {[round(s['update_s'], 2) for s in both['steps'][mode]]}",
                  flush=True)
        print(json.dumps({dtype: both}), flush=True)  # the raw steps, kept should a later setting fail
    floor_after = run(args, kind="floor")
    floor = {k: max(floor_before[k], floor_after[k]) for k in floor_before}
    print(f"matmul floor (higher of before/after): fp32 {floor['float32']:.1f}, bf16 {floor['bfloat16']:.1f} GFLOP/s")
    table = {}
    print("| setting | update s/step | % of floor | compile s | steps to pay back | graphs compiled |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for mode in ("eager", "compiled"):
            steps = results[f"{dtype} {mode}"]["steps"]
            counted = steps[args.warmup:]
            seconds = sum(s["update_s"] for s in counted) / len(counted)
            tokens = sum(s["tokens"] for s in counted) / len(counted)
            fraction = 6 * params * tokens / seconds / 1e9 / floor[dtype]
            row = {"update_s": seconds, "floor_fraction": fraction, "graphs": steps[-1]["graphs"],
                   "graphs_after_first_step": steps[0]["graphs"],
                   "first_step_s": steps[0]["update_s"]}
            if mode == "compiled":
                eager, eager_first = table[f"{dtype} eager"]["update_s"], table[f"{dtype} eager"]["first_step_s"]
                # the first step's extra over a counted one, less the eager side's (allocator, caches): the compile
                row["compile_s"] = steps[0]["update_s"] - seconds - (eager_first - eager)
                saved = eager - seconds
                row["payback_steps"] = row["compile_s"] / saved if saved > 0 else None
            table[f"{dtype} {mode}"] = row
            compile_s = f"{row['compile_s']:.0f}" if "compile_s" in row else "-"
            payback = "-" if mode == "eager" else "never" if row["payback_steps"] is None else \
                f"{row['payback_steps']:.0f}"
            graphs = f"{row['graphs_after_first_step']} after step 1, {row['graphs']} at the end" \
                if mode == "compiled" else "-"
            print(f"| {dtype} {mode} | {seconds:.2f} | {100 * fraction:.0f} % | {compile_s} | {payback} | {graphs} |")
    print(json.dumps({"machine": machine_line(args.model, args.device), "threads": args.threads,
                      "floor_gflops": floor, "settings": table,
                      "args": {k: v for k, v in vars(args).items() if k != "worker"}}))


if __name__ == "__main__":
    main()
