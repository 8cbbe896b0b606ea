"""A GRPO step on a real model, grpolab and TRL 1.16's GRPOTrainer side by side (prints figures;
not a test). ``make bench-real`` runs it in its own venv (.venv-bench: grpolab + trl==1.16.0).

The step, the same on both sides: SmolLM2-135M-Instruct (the cache ``make test-real`` fills),
two-number addition asked in chat form through the model's own chat template, 64 completions per
optimizer step (8 prompts x 8), at most 128 new tokens, temperature 1, top-p 1, reward = the last
number equals the sum (``question_only``), group-normalised advantages with std scaling, per-sequence
token mean (TRL ``loss_type="grpo"``, grpolab ``masked_mean``), on-policy (one iteration), no
reference model, AdamW (0.9, 0.95) at a constant 1e-6, gradient clipping at 1.0, micro-batches of 8
rows (8 accumulation steps).

Each (side, setting, round) runs in its own subprocess, so each gets the same process budget and its
own peak RSS; rounds alternate between the sides (grpolab, TRL, grpolab, TRL, ...) so a change in
the machine's load falls on both. In each run the first ``--warmup`` steps are not counted. Figures:

- completions/s and response tokens/s over the counted steps;
- seconds per step split into rollout (sampling + scoring), log-probs (old/reference passes before
  the update; none here, on-policy), update (forward, backward, optimizer step) and sync (giving a
  separate sampler the new weights; none here);
- the fraction of the machine's matmul floor each phase reaches: the model's matmul FLOPs for the
  real (unpadded) tokens the phase puts through the model (2 x parameters per token forward, 6 x in
  training; the rollout counts the generated tokens), per second, over the floor: the best
  ``torch.mm`` GFLOP/s at the model's own layer shapes (fp32: a 1,024-token batch, about one
  micro-batch; bf16: 256 tokens) measured here with the same thread count, before and after the
  runs (the higher of the two: a shared host's floor moves by a third between minutes);
- peak RSS of the process.

Settings: ``--dtypes`` (float32, bfloat16: autocast on both sides) x ``--threads``. Each side's best
setting is the one with the most completions/s; the ratio is grpolab's best over TRL's best, and
also fp32 against fp32.

Settings are also ``grpolab-all-rows``: grpolab without skipping rows whose advantage is zero (it
trains every row, as TRL does), which shows how much of the lead the skipping is on this task.

Usage: python benchmarks/real_model.py [--rounds 1] [--steps 1] [--warmup 1] [--threads N,1]
       [--dtypes auto|float32,bfloat16] [--sides grpolab,grpolab-all-rows,trl] [--model DIR] [--device cuda]
With the defaults it takes ~25 minutes on 2 cores (TRL's runs are most of it).
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUP, PROMPTS_PER_STEP, MAX_NEW, MICRO_ROWS, LR, SEED = 8, 8, 128, 8, 1e-6, 0
ROOT = Path(__file__).resolve().parents[1]


def questions(n: int = 512) -> list[dict]:
    """Two-number addition in chat form (SmolLM2-135M gets a fair share right: groups have signal)."""
    rng = random.Random(SEED)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return out


def default_model() -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    import real_model

    path, why = real_model.status()
    if path is None:
        sys.exit(f"real_model.py: SmolLM2-135M-Instruct unavailable: {why} (make real-model fetches it)")
    return str(path)


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_params(model_dir: str) -> tuple[int, list[tuple[int, int, int]]]:
    """The model's matmul parameters (every linear layer and the tied output head) and its distinct
    (in, out, count) linear shapes."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    d, ff, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    shapes = [(d, d + 2 * kv, layers), (d, d, layers), (d, 2 * ff, layers), (ff, d, layers), (d, vocab, 1)]
    return sum(i * o * c for i, o, c in shapes), shapes


def machine(device: str = "cpu") -> tuple[str, str]:
    """(the CPU's model name, or the GPU's and its host's; the CPU's widest vector/bf16 instructions)."""
    from grpolab.training.resources import cpu_flags

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = cpu_flags()
    isa = "AMX" if "amx_bf16" in flags else "AVX-512-bf16" if "avx512_bf16" in flags else \
        "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    if device.startswith("cuda"):
        import torch

        cpu = f"{torch.cuda.get_device_name()} (GPU), host {cpu}"
    return cpu, isa


def machine_line(model_dir: str, device: str = "cpu") -> str:
    cpu, isa = machine(device)
    params, _ = matmul_params(model_dir)
    return (f"machine: {cpu}, {os.cpu_count()} cores, {isa}; model {Path(model_dir).name} "
            f"({params / 1e6:.1f}M matmul parameters)")


# ---------------------------------------------------------------- workers (one subprocess each)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def floor_worker(args) -> dict:
    """The best ``F.linear`` GFLOP/s (the call the models make) at the model's layer shapes for
    ``floor_tokens`` rows, each shape weighted by how often the model runs it, at this thread count."""
    import torch
    import torch.nn.functional as F

    _, shapes = matmul_params(args.model)
    out = {}
    for dtype in ("float32", "bfloat16"):
        dt = getattr(torch, dtype)
        flops = seconds = 0.0
        # a CPU without bf16 instructions runs bf16 matmuls ~8x slower: a quarter of the rows is enough there
        rows = args.floor_tokens if dtype == "float32" else max(1, args.floor_tokens // 4)
        for i, o, count in shapes:
            x, w = torch.randn(rows, i, dtype=dt, device=args.device), torch.randn(o, i, dtype=dt, device=args.device)
            F.linear(x, w)
            best = float("inf")
            for _ in range(3):
                sync(args.device)
                t = time.perf_counter()
                F.linear(x, w)
                sync(args.device)
                best = min(best, time.perf_counter() - t)
            flops += 2 * rows * i * o * count
            seconds += best * count
        out[dtype] = flops / seconds / 1e9
    return out


def grpolab_worker(args) -> dict:
    import torch

    from grpolab.algorithms.grpo import GRPOConfig, train_grpo

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "questions.jsonl"
        data.write_text("".join(json.dumps(q) + "\n" for q in questions()))
        cfg = GRPOConfig(
            model=args.model, train_data=str(data), prompt_template="chat", reward="question_only",
            rollout_batch_size=GROUP * PROMPTS_PER_STEP, group_size=GROUP, train_batch_size=GROUP * PROMPTS_PER_STEP,
            gradient_accumulation_steps=GROUP * PROMPTS_PER_STEP // MICRO_ROWS, learning_rate=LR, warmup_steps=0,
            lr_schedule="constant", betas=(0.9, 0.95), max_grad_norm=1.0, loss_type="reinforce_with_baseline",
            length_normalization="masked_mean", use_std_normalization=True, kl_coef=0.0, kl_stop=None,
            sampling_temperature=1.0, sampling_top_p=1.0, sampling_max_tokens=MAX_NEW, sampling_min_tokens=0,
            stop=[], n_grpo_steps=args.warmup + args.steps, dtype=args.dtype, seed=SEED, device=args.device,
            run_dir=str(Path(tmp) / "run"), show_progress=False, token_record_groups=0, log_generations_samples=0,
            **({"skip_zero_advantage": False} if args.worker == "grpolab-all-rows" else {}),
            **json.loads(args.grpolab_options))
        train_grpo(cfg, overwrite=True)
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/rollout_s" in r][args.warmup:]
    phases = []
    for r in steps:
        log_probs = r["time/log_probs_s"]
        phases.append({"rollout": r["time/rollout_s"], "log_probs": log_probs,
                       "update": r["time/train_s"] - log_probs, "sync": r["time/weight_sync_s"],
                       "response_tokens": r["train/response_length"] * GROUP * PROMPTS_PER_STEP,
                       "train_tokens": r.get("train/forward_tokens", 0), "reward": r["train/reward"]})
    return {"steps": phases, "threads": torch.get_num_threads()}


def trl_worker(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpolab.rewards import question_only_reward_fn

    qs = questions()
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": q["question"]}] for q in qs],
                              "answer": [q["answer"] for q in qs]})

    def reward(completions, answer, **kwargs):
        return [question_only_reward_fn(c[0]["content"], a)["reward"] for c, a in zip(completions, answer)]

    steps: list[dict] = []
    current: dict = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            current.clear()
            current.update(rollout=0.0, log_probs=0.0, t0=time.perf_counter(), response_tokens=0, prompt_tokens=0)

        def on_step_end(self, a, state, control, **kw):
            total = time.perf_counter() - current.pop("t0")
            steps.append({**current, "update": total - current["rollout"] - current["log_probs"], "sync": 0.0})

    class TimedGRPOTrainer(GRPOTrainer):
        """Only timing: the rollout is ``_generate_and_score_completions`` less the log-prob passes it runs."""

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            lp_before = current.get("log_probs", 0.0)
            self._in_rollout = True
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self._in_rollout = False
            current["rollout"] += time.perf_counter() - t - (current["log_probs"] - lp_before)
            current["response_tokens"] += int(out["completion_mask"].sum())
            current["prompt_tokens"] += int(out["prompt_mask"].sum())
            current.setdefault("rewards", []).append(float(self._metrics["train"].get("reward", [0.0])[-1]))
            return out

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            if not getattr(self, "_in_rollout", False):
                return super()._get_per_token_logps_and_entropies(*a, **kw)
            t = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*a, **kw)
            current["log_probs"] += time.perf_counter() - t
            return out

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=MICRO_ROWS, num_generations=GROUP,
                         gradient_accumulation_steps=GROUP * PROMPTS_PER_STEP // MICRO_ROWS,
                         max_completion_length=MAX_NEW, temperature=1.0, top_p=1.0, learning_rate=LR,
                         lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
                         weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="grpo", scale_rewards="group",
                         num_iterations=1, max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no",
                         report_to="none", use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16", seed=SEED,
                         shuffle_dataset=True, disable_dropout=True, **json.loads(args.trl_options))
        trainer = TimedGRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=data,
                                   processing_class=tok, callbacks=[Timer()])
        trainer.train()
    counted = steps[args.warmup:]
    for s in counted:
        s["train_tokens"] = s["response_tokens"] + s["prompt_tokens"]
        rewards = s.pop("rewards", [0.0])
        s["reward"] = sum(rewards) / len(rewards)
    return {"steps": counted, "threads": torch.get_num_threads()}


def worker_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    result = {"floor": floor_worker, "grpolab": grpolab_worker, "grpolab-all-rows": grpolab_worker,
              "trl": trl_worker}[args.worker](args)
    result["peak_rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the parent: rounds, table


def run_worker(args, worker: str, threads: int, dtype: str = "float32") -> dict:
    cmd = [sys.executable, __file__, "--worker", worker, "--model", args.model, "--threads", str(threads),
           "--dtype", dtype, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--floor-tokens", str(args.floor_tokens), "--grpolab-options", args.grpolab_options,
           "--trl-options", args.trl_options, "--device", args.device]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        sys.exit(f"real_model.py: the {worker} run ({dtype}, {threads} threads) failed:\n{tail}")
    return json.loads(lines[-1][len("RESULT "):])


def summarise(runs: list[dict], params: int, floor: dict, dtype: str) -> dict:
    steps = [s for r in runs for s in r["steps"]]
    n = len(steps)
    mean = {k: sum(s[k] for s in steps) / n for k in ("rollout", "log_probs", "update", "sync", "response_tokens",
                                                     "train_tokens", "reward")}
    per_step = mean["rollout"] + mean["log_probs"] + mean["update"] + mean["sync"]
    gflops = floor[dtype]
    return {
        "steps": n, "s_per_step": per_step, "completions_per_s": GROUP * PROMPTS_PER_STEP / per_step,
        "tokens_per_s": mean["response_tokens"] / per_step,
        **{f"{k}_s": mean[k] for k in ("rollout", "log_probs", "update", "sync")},
        "rollout_floor_fraction": 2 * params * mean["response_tokens"] / mean["rollout"] / 1e9 / gflops,
        "update_floor_fraction": 6 * params * mean["train_tokens"] / mean["update"] / 1e9 / gflops,
        "response_length": mean["response_tokens"] / (GROUP * PROMPTS_PER_STEP), "reward": mean["reward"],
        "train_tokens": mean["train_tokens"], "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct cache (make real-model)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1, help="counted steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted steps at the start of each run")
    ap.add_argument("--threads", default=f"{os.cpu_count()},1")
    ap.add_argument("--dtypes", default="auto", help="auto: float32, and bfloat16 where its matmul floor beats fp32's")
    ap.add_argument("--sides", default="grpolab,grpolab-all-rows,trl",
                    help="grpolab-all-rows: grpolab without skipping zero-advantage rows (every row trained, as TRL)")
    ap.add_argument("--floor-tokens", type=int, default=1024)
    ap.add_argument("--grpolab-options", default="{}", help="JSON: extra GRPOConfig fields for grpolab")
    ap.add_argument("--trl-options", default="{}", help="JSON: extra GRPOConfig fields for TRL")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (benchmarks/gpu_check.sh)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.model = args.model or default_model()
    if args.worker:
        args.threads = int(args.threads)
        return worker_main(args)

    params, _ = matmul_params(args.model)
    thread_counts = [int(t) for t in args.threads.split(",")]
    dtypes, sides = args.dtypes.split(","), args.sides.split(",")
    cpu, isa = machine(args.device)
    print(f"{machine_line(args.model, args.device)}; {GROUP * PROMPTS_PER_STEP} completions/step, <= {MAX_NEW} tokens",
          flush=True)
    floors_before = {t: run_worker(args, "floor", t) for t in thread_counts}
    floors = floors_before  # the dtype decision is taken on these; the fractions on the higher of before/after
    for t, f in floors.items():
        print(f"matmul floor, {t} thread(s): fp32 {f['float32']:.1f} GFLOP/s, bf16 {f['bfloat16']:.1f} GFLOP/s",
              flush=True)
    if args.dtypes == "auto":
        dtypes = ["float32"]
        if any(f["bfloat16"] > f["float32"] for f in floors.values()):
            dtypes.append("bfloat16")
        else:
            print(f"bf16 not run: its matmuls reach {max(f['bfloat16'] for f in floors.values()):.1f} GFLOP/s here "
                  f"against fp32's {max(f['float32'] for f in floors.values()):.1f} ({isa}: no bf16 instructions), so "
                  "neither side's best setting is bf16 (--dtypes float32,bfloat16 runs it anyway)", flush=True)
    settings = [(side, dtype, t) for dtype in dtypes for t in thread_counts for side in sides]
    runs: dict[tuple, list] = {s: [] for s in settings}
    for rnd in range(args.rounds):
        for setting in settings:  # alternating: grpolab, TRL, grpolab, TRL, ...
            t0 = time.perf_counter()
            result = run_worker(args, setting[0], setting[2], setting[1])
            runs[setting].append(result)
            seconds = sum(s["rollout"] + s["log_probs"] + s["update"] + s["sync"] for s in result["steps"])
            print(
                f"round {rnd + 1}: {setting[0]} {setting[1]} {setting[2]} thread(s): "
                f"{GROUP * PROMPTS_PER_STEP * len(result['steps']) / seconds:.2f} completions/s "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    floors_after = {t: run_worker(args, "floor", t) for t in thread_counts}
    for t, f in floors_after.items():
        print(f"matmul floor after the runs, {t} thread(s): fp32 {f['float32']:.1f} GFLOP/s, "
              f"bf16 {f['bfloat16']:.1f} GFLOP/s (the fractions use the higher of before and after)", flush=True)
    floors = {t: {**f, **{k: max(f[k], floors_after[t][k]) for k in ("float32", "bfloat16")}}
              for t, f in floors_before.items()}
    table = {f"{side} {dtype} {t}t": summarise(runs[(side, dtype, t)], params, floors[t], dtype)
             for side, dtype, t in settings}
    head = ("setting", "compl/s", "tok/s", "s/step", "rollout", "log-probs", "update", "sync", "rollout %floor",
            "update %floor", "resp len", "reward", "peak RSS MB")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, s in table.items():
        print(f"| {name} | {s['completions_per_s']:.2f} | {s['tokens_per_s']:.0f} | {s['s_per_step']:.1f} | "
              f"{s['rollout_s']:.1f} | {s['log_probs_s']:.1f} | {s['update_s']:.1f} | {s['sync_s']:.1f} | "
              f"{100 * s['rollout_floor_fraction']:.0f} % | {100 * s['update_floor_fraction']:.0f} % | "
              f"{s['response_length']:.0f} | {s['reward']:.3f} | {s['peak_rss_mb']:.0f} |")
    summary = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "isa": isa}, "floor_gflops": floors,
               "floor_gflops_before_after": {t: [floors_before[t], floors_after[t]] for t in thread_counts},
               "table": table}
    if set(sides) >= {"grpolab", "trl"}:
        best = {side: max((n for n in table if n.startswith(side + " ")), key=lambda n: table[n]["completions_per_s"])
                for side in ("grpolab", "trl")}
        if "grpolab-all-rows" in sides:
            best["grpolab-all-rows"] = max((n for n in table if n.startswith("grpolab-all-rows ")),
                                           key=lambda n: table[n]["completions_per_s"])
            all_rows = table[best["grpolab-all-rows"]]["completions_per_s"] / table[best["trl"]]["completions_per_s"]
            print(f"grpolab training every row (no zero-advantage skipping), best {best['grpolab-all-rows']}: "
                  f"{all_rows:.2f}x TRL's best")
            summary["ratio_all_rows"] = all_rows
        ratio = table[best["grpolab"]]["completions_per_s"] / table[best["trl"]]["completions_per_s"]
        print(f"\nbest: grpolab {best['grpolab']}, TRL {best['trl']}: grpolab / TRL = {ratio:.2f}x completions/s")
        summary.update(best=best, ratio_best=ratio)
        if "float32" in dtypes:
            fp32 = {side: max((n for n in table if n.startswith(f"{side} float32")),
                              key=lambda n: table[n]["completions_per_s"]) for side in ("grpolab", "trl")}
            summary["ratio_fp32"] = (
                table[fp32["grpolab"]]["completions_per_s"] / table[fp32["trl"]]["completions_per_s"]
            )
            print(f"fp32 vs fp32 ({fp32['grpolab']} / {fp32['trl']}): {summary['ratio_fp32']:.2f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
