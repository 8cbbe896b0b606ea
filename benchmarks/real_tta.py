"""Time to accuracy on a real model: grpolab and TRL 1.16's GRPOTrainer side by side, on two tasks
(prints figures; not a test). ``make bench-tta`` runs it in the benchmark venv (.venv-bench).

Both sides start from the same SmolLM2-135M-Instruct (the ``make real-model`` cache) and train on the
same task with the settings of its grpolab config in ``configs/real/``:

- ``arithmetic``: ``smollm2_135m_grpo_arithmetic.yaml`` (two-digit addition asked in words);
- ``basic_arithmetic``: ``smollm2_135m_grpo_rg_basic_arithmetic.yaml`` (reasoning-gym's basic_arithmetic,
  one + or - between numbers of 1-2 digits, the reply's last number scored by the dataset's own
  ``score_answer``);
- ``chain_sum`` (not run by default): ``smollm2_135m_grpo_rg_chain_sum.yaml`` (reasoning-gym's chain_sum,
  2-3 one-digit terms with + and -), where neither side learned much in 1,024 samples.

Shared from the config: the prompts (grpolab's chat template with the system prompt, rendered once
and given to TRL as text), the training questions, the reward function, group size 8, 32 samples and
one optimizer step per rollout batch (micro-batches of 16), learning rate 2e-5 constant, AdamW betas
and weight decay, gradient clipping, temperature 0.7, top-p 1, at least 1 and at most 24 new tokens,
a response ending at its first newline. The loss, each side's nearest equivalent of the other's:
grpolab ``reinforce_with_baseline`` with std-normalised group advantages and a per-sequence token
mean (``masked_mean``), skipping groups whose advantage is zero (same gradient); TRL ``loss_type="grpo"``
with ``scale_rewards="group"``, ``beta=0``, one iteration (so its clipped ratio is 1: the same
policy gradient). TRL stops at a newline through the model's end ids (its completion mask ends
there, as grpolab's stop string does).

Held-out accuracy: the task's test split (``--eval-n`` questions, default 200), greedy, scored by the
config's reward, measured the same way on both sides (grpolab's evaluator on each side's model
object, in the training process) before training, every ``--eval-every`` samples and at the end;
sampled accuracy (T = the config's eval_temperature, one sample per question) before and at the end.
The clock is the training loop's wall time with the evaluations taken out (each side's set-up,
model load and trainer construction are not counted and are reported apart). Time to target: the
training seconds at the first evaluation whose greedy accuracy reaches ``--targets``; ``tta_ratio``
= TRL's over grpolab's (the mean over seeds where both reached it; a lower bound, marked, where TRL
did not within the budget). Each (task, seed, side) is its own subprocess, the sides alternate
(grpolab, TRL, grpolab, TRL, ...), each at its best setting here: ``--threads`` (default all cores)
and ``--dtype auto`` (bf16 autocast where grpolab's dtype probe picks it, for both sides).

Usage: python benchmarks/real_tta.py [--tasks arithmetic,basic_arithmetic] [--seeds 0] [--samples 1024]
       [--eval-every 128] [--eval-n 200] [--targets arithmetic=0.3,basic_arithmetic=0.3] [--plot FILE]
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"arithmetic": "configs/real/smollm2_135m_grpo_arithmetic.yaml",
           "chain_sum": "configs/real/smollm2_135m_grpo_rg_chain_sum.yaml",
           "basic_arithmetic": "configs/real/smollm2_135m_grpo_rg_basic_arithmetic.yaml"}
TARGETS = {"arithmetic": 0.30, "chain_sum": 0.30, "basic_arithmetic": 0.30}


def step_benchmark():
    """``benchmarks/real_model.py`` (its model cache, machine line and matmul parameters), by path:
    ``scripts/real_model.py`` has the same module name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_real_model", ROOT / "benchmarks" / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def task_config(args, task: str, seed: int, run_dir: str):
    """The task's grpolab config with this benchmark's model, seed, budget and quiet logging."""
    import yaml

    from grpolab.algorithms.grpo import GRPOConfig

    fields = yaml.safe_load((ROOT / CONFIGS[task]).read_text())
    fields.update(model=args.model, seed=seed, run_dir=run_dir, show_progress=False, token_record_groups=0,
                  log_generations_samples=0, eval_examples=1, threads=args.threads, dtype=args.dtype)
    fields["n_grpo_steps"] = args.samples // fields["rollout_batch_size"]
    return GRPOConfig(**fields)


def autocast_dtype_of(dtype: str):
    import torch

    return torch.bfloat16 if dtype == "bfloat16" else None


class Meter:
    """Held-out accuracy at fixed sample counts against the training clock (evaluations excluded)."""

    def __init__(self, cfg, tokenizer, n: int, every: int, budget: int, dtype):
        from grpolab.rewards import RewardScorer
        from grpolab.training.inputs import task_or_file

        source = cfg.task if cfg.task.startswith("rg:") else f"task:{cfg.task}"
        self.examples, self.template, reward = task_or_file(
            source, n, seed=cfg.seed, split="test", prompt_template=cfg.prompt_template, reward=cfg.reward,
            task_options=cfg.task_options, tokenizer=tokenizer, system_prompt=cfg.system_prompt)
        self.scorer = RewardScorer(reward, timeout_s=cfg.reward_timeout_s, num_workers=1, device="cpu")
        self.cfg, self.tokenizer, self.every, self.budget, self.dtype = cfg, tokenizer, every, budget, dtype
        self.curve: list[dict] = []
        self.sampled: dict[str, float] = {}
        self.t0 = self.paused = 0.0
        self.eval_s = 0.0

    def accuracy(self, model, temperature: float) -> float:
        import torch

        from grpolab.eval.evaluation import evaluate
        from grpolab.rollout.base import SamplingParams
        from grpolab.rollout.hf import HFRolloutBackend

        t = time.perf_counter()
        backend = HFRolloutBackend(model, self.tokenizer, autocast_dtype=self.dtype,
                                   generator=torch.Generator().manual_seed(1234))
        sampling = SamplingParams(temperature=temperature, max_tokens=self.cfg.sampling_max_tokens,
                                  min_tokens=self.cfg.sampling_min_tokens, stop=list(self.cfg.stop))
        was_training = model.training
        model.eval()
        result = evaluate(backend, self.examples, self.template, self.scorer.reward_fn, sampling, scorer=self.scorer)
        model.train(was_training)
        self.eval_s += time.perf_counter() - t
        return result.metrics["accuracy"]

    def start(self, model) -> None:
        self.sampled["before"] = self.accuracy(model, self.cfg.eval_temperature)
        self.point(model, 0)
        self.t0, self.paused = time.perf_counter(), 0.0

    def point(self, model, samples: int) -> None:
        train_s = time.perf_counter() - self.t0 - self.paused if samples else 0.0
        t = time.perf_counter()
        self.curve.append({"samples": samples, "train_s": train_s, "accuracy": self.accuracy(model, 0.0)})
        if samples >= self.budget:
            self.sampled["after"] = self.accuracy(model, self.cfg.eval_temperature)
        self.paused += time.perf_counter() - t
        print(f"  {samples} samples, {train_s:.0f} s: held-out greedy accuracy {self.curve[-1]['accuracy']:.3f}",
              file=sys.stderr, flush=True)

    def after_step(self, model, samples: int) -> None:
        if samples % self.every == 0 or samples >= self.budget:
            self.point(model, samples)

    def result(self, setup_s: float) -> dict:
        self.scorer.close()
        return {"curve": self.curve, "sampled": self.sampled, "setup_s": setup_s, "eval_s": self.eval_s}


# ---------------------------------------------------------------- workers (one subprocess each)


def grpolab_worker(args) -> dict:
    """grpolab's ``train_grpo`` on the task's config; the meter runs before the loop and after each step."""
    from grpolab.algorithms.grpo import train_grpo
    from grpolab.training.run import Run

    t_setup = time.perf_counter()
    holder: dict = {}
    steps, end_step = Run.steps, Run.end_step

    def timed_steps(run):  # the loop begins: the "before" point, then the clock starts
        cfg = run.cfg
        holder["meter"] = Meter(cfg, run.tokenizer, args.eval_n, args.eval_every, args.samples,
                                autocast_dtype_of(cfg.dtype))
        holder["setup_s"] = time.perf_counter() - t_setup
        holder["meter"].start(run.model)
        return steps(run)

    def metered_end_step(run, done, validate=None):
        end_step(run, done, validate)
        holder["meter"].after_step(run.model, done * run.cfg.rollout_batch_size)

    Run.steps, Run.end_step = timed_steps, metered_end_step
    with tempfile.TemporaryDirectory() as tmp:
        cfg = task_config(args, args.task, args.seed, str(Path(tmp) / "run"))
        train_grpo(cfg, overwrite=True)
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    lengths = [r["train/response_length"] for r in records if "train/response_length" in r]
    return {**holder["meter"].result(holder["setup_s"]), "dtype": cfg.dtype,
            "response_length": sum(lengths) / max(1, len(lengths))}


def trl_config(cfg, seed: int, dtype: str, out_dir: str, max_steps: int):
    """TRL 1.16's GRPOConfig for grpolab's ``cfg`` (the same algorithm: no KL, group-scaled rewards, one
    iteration, constant lr, no warm-up), as the comparison runs it; benchmarks/first_update.py uses it too."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=cfg.train_batch_size // cfg.gradient_accumulation_steps,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, num_generations=cfg.group_size,
        max_completion_length=cfg.sampling_max_tokens, temperature=cfg.sampling_temperature, top_p=1.0,
        generation_kwargs={"min_new_tokens": cfg.sampling_min_tokens}, learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1],
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, beta=0.0, loss_type="grpo",
        scale_rewards="group", num_iterations=1, max_steps=max_steps, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, bf16=dtype == "bfloat16", seed=seed,
        shuffle_dataset=True, disable_dropout=True, disable_tqdm=True)  # no bar among the meter's lines


def end_at_newline(model, tok) -> None:
    """A TRL response ends at its first newline, as grpolab's stop string ends it: every token whose text
    holds one becomes an end id of ``model.generation_config`` (TRL's completion mask ends there)."""
    newline_ids = [i for i in range(len(tok)) if "\n" in tok.decode([i])]
    ends = model.generation_config.eos_token_id
    ends = [ends] if isinstance(ends, int) else list(ends or [])
    model.generation_config.eos_token_id = sorted({tok.eos_token_id, *ends, *newline_ids})


def trl_worker(args) -> dict:
    """TRL's ``GRPOTrainer`` with the config's settings; the meter runs from a ``TrainerCallback``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from grpolab.training.inputs import load_inputs
    from grpolab.training.resources import choose_dtype, model_shape

    t_setup = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = task_config(args, args.task, args.seed, "unused")  # no run directory: TRL writes its own
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    # dtype auto: grpolab's own decision on the same model, so both sides choose alike
    dtype, line = choose_dtype(cfg.dtype, "cpu", model_shape(model))
    if line:
        print(f"  {line}", file=sys.stderr, flush=True)
    inputs = load_inputs(cfg, tok)
    data = Dataset.from_dict({"prompt": [inputs.template.format(e.question) for e in inputs.train],
                              "gt": [json.dumps(e.answer) for e in inputs.train]})
    end_at_newline(model, tok)
    meter = Meter(cfg, tok, args.eval_n, args.eval_every, args.samples, autocast_dtype_of(dtype))

    def reward(prompts, completions, gt, **kwargs):  # the config's reward, scored as grpolab's run scores it
        return [s["reward"] for s in meter.scorer.score(completions, [json.loads(g) for g in gt])]
    per_step = cfg.rollout_batch_size

    class Metered(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            meter.start(model)

        def on_step_end(self, a, state, control, model=None, **kw):
            meter.after_step(model, state.global_step * per_step)

    with tempfile.TemporaryDirectory() as out:
        trl_cfg = trl_config(cfg, args.seed, dtype, out, args.samples // per_step)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=trl_cfg, train_dataset=data,
                              processing_class=tok, callbacks=[Metered()])
        setup_s = time.perf_counter() - t_setup
        trainer.train()
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {**meter.result(setup_s), "dtype": dtype, "response_length": sum(lengths) / max(1, len(lengths))}


def worker_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    result = {"grpolab": grpolab_worker, "trl": trl_worker}[args.worker](args)
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the parent: alternating runs, the table


def run_worker(args, side: str, task: str, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--task", task, "--seed", str(seed), "--model", args.model,
           "--threads", str(args.threads), "--dtype", args.dtype, "--samples", str(args.samples),
           "--eval-every", str(args.eval_every), "--eval-n", str(args.eval_n)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        tail: list[str] = []
        for line in proc.stderr:  # the meter's points as they come; the rest kept for a failure's message
            if line.startswith("  ") and ("held-out" in line or "dtype auto" in line):
                print(f"  {task} seed {seed} {side}:{line.rstrip()}", file=sys.stderr, flush=True)
            tail = (tail + [line.rstrip()])[-15:]
        proc.wait()
        out.seek(0)
        lines = [line for line in out.read().splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"real_tta.py: the {side} run ({task}, seed {seed}) failed:\n" + "\n".join(tail))
    return json.loads(lines[-1][len("RESULT "):])


def seconds_to(curve: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation after the start reaching ``target`` (None: not within
    the budget)."""
    return next((p["train_s"] for p in curve[1:] if p["accuracy"] >= target), None)


def summarise(task: str, runs: dict, target: float) -> dict:
    """Per seed: each side's seconds to the target, final accuracies; the task's ``tta_ratio``."""
    seeds = sorted({seed for _, seed in runs})
    out: dict = {"target": target, "seeds": {}}
    reached, bounds = [], []
    for seed in seeds:
        g, t = runs[("grpolab", seed)], runs[("trl", seed)]
        gs, ts = seconds_to(g["curve"], target), seconds_to(t["curve"], target)
        row = {side: {"seconds_to_target": s, "final_greedy": r["curve"][-1]["accuracy"],
                      "before_greedy": r["curve"][0]["accuracy"], "sampled": r["sampled"],
                      "train_s": r["curve"][-1]["train_s"], "setup_s": r["setup_s"], "eval_s": r["eval_s"],
                      "dtype": r["dtype"]}
               for side, r, s in (("grpolab", g, gs), ("trl", t, ts))}
        out["seeds"][seed] = row
        if gs is not None and ts is not None:
            reached.append((gs, ts))
        elif gs is not None:  # TRL did not reach it: its whole budget is a lower bound on its time
            bounds.append((gs, t["curve"][-1]["train_s"]))
    if any(r["curve"][0]["accuracy"] >= target for r in runs.values()):
        out["warning"] = "the start already reaches the target: raise --targets"
    if reached:
        out["tta_ratio"] = sum(t for _, t in reached) / sum(g for g, _ in reached)
        out["tta_ratio_is_lower_bound"] = False
    elif bounds:
        out["tta_ratio"] = sum(t for _, t in bounds) / sum(g for g, _ in bounds)
        out["tta_ratio_is_lower_bound"] = True
    else:
        out["tta_ratio"] = None
    per_sample = {side: sum(r["curve"][-1]["train_s"] for (s, _), r in runs.items() if s == side)
                  / sum(r["curve"][-1]["samples"] for (s, _), r in runs.items() if s == side)
                  for side in ("grpolab", "trl")}
    out["s_per_128_samples"] = {side: 128 * v for side, v in per_sample.items()}
    out["speed_ratio"] = per_sample["trl"] / per_sample["grpolab"]
    return out


def plot(path: str, results: dict, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(summary)
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        seeds = sorted({seed for _, seed in results[task]})
        for (side, seed), r in results[task].items():
            xs, ys = [p["train_s"] for p in r["curve"]], [100 * p["accuracy"] for p in r["curve"]]
            ax.plot(xs, ys, marker="o", ms=3, color="tab:blue" if side == "grpolab" else "tab:orange",
                    ls=("-", "--", ":", "-.")[seeds.index(seed) % 4],
                    label=f"{'grpolab' if side == 'grpolab' else 'TRL 1.16'}, seed {seed}")
        ax.axhline(100 * summary[task]["target"], color="grey", ls="--", lw=1, label="target")
        ax.set(title=f"SmolLM2-135M-Instruct, {task}", xlabel="training wall seconds (evaluations excluded)",
               ylabel="held-out accuracy, greedy (%)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct cache (make real-model)")
    ap.add_argument("--tasks", default="arithmetic,basic_arithmetic", help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--seeds", default="0", help="comma-separated training seeds (each: a run per side)")
    ap.add_argument("--samples", type=int, default=1024, help="the budget: samples per run (32 per step)")
    ap.add_argument("--eval-every", type=int, default=128, help="samples between held-out evaluations")
    ap.add_argument("--eval-n", type=int, default=200, help="held-out test questions")
    ap.add_argument("--targets", default=",".join(f"{k}={v}" for k, v in TARGETS.items()),
                    help="greedy held-out accuracy to reach, per task")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="auto", help="auto (grpolab's probe, for both sides), float32 or bfloat16")
    ap.add_argument("--sides", default="grpolab,trl")
    ap.add_argument("--plot", default=None, help="write the accuracy-vs-seconds plot here (PNG)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--task", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.model = args.model or step_benchmark().default_model()
    if args.worker:
        return worker_main(args)

    tasks, seeds, sides = args.tasks.split(","), [int(s) for s in args.seeds.split(",")], args.sides.split(",")
    targets = {**TARGETS, **{k: float(v) for k, v in (kv.split("=") for kv in args.targets.split(",") if kv)}}
    unknown = [t for t in tasks if t not in CONFIGS]
    if unknown:
        sys.exit(f"real_tta.py: --tasks: unknown {', '.join(unknown)} (choose from {', '.join(CONFIGS)})")
    machine = step_benchmark().machine_line(args.model)
    print(f"{machine}; {args.threads} threads; budget {args.samples} samples per run, held-out greedy accuracy "
          f"on {args.eval_n} test questions every {args.eval_every} samples", flush=True)
    results: dict = {task: {} for task in tasks}
    for seed in seeds:
        for task in tasks:
            for side in sides:  # alternating: grpolab, TRL, grpolab, TRL, ...
                t0 = time.perf_counter()
                r = run_worker(args, side, task, seed)
                results[task][(side, seed)] = r
                print(f"{task} seed {seed} {side} ({r['dtype']}): " + ", ".join(
                    f"{p['samples']}:{p['train_s']:.0f}s:{100 * p['accuracy']:.1f}%" for p in r["curve"])
                    + f" ({time.perf_counter() - t0:.0f} s in all)", flush=True)
                print(f"  before -> after: greedy {100 * r['curve'][0]['accuracy']:.1f} -> "
                      f"{100 * r['curve'][-1]['accuracy']:.1f} %, sampled {100 * r['sampled']['before']:.1f} -> "
                      f"{100 * r['sampled']['after']:.1f} %; set-up {r['setup_s']:.0f} s, "
                      f"evaluations {r['eval_s']:.0f} s, "
                      f"mean response {r['response_length']:.1f} tokens", flush=True)
    both = set(sides) >= {"grpolab", "trl"}
    summary = {task: summarise(task, results[task], targets[task]) for task in tasks} if both else {}
    head = ("task", "seed", "side", "before", "after (greedy)", "sampled before -> after", "s to target",
            "train s", "s / 128 samples")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for task, s in summary.items():
        for seed, row in s["seeds"].items():
            for side, f in row.items():
                reach = "not reached" if f["seconds_to_target"] is None else f"{f['seconds_to_target']:.0f}"
                print(f"| {task} (target {100 * s['target']:.0f} %) | {seed} | {side} | "
                      f"{100 * f['before_greedy']:.1f} % | {100 * f['final_greedy']:.1f} % | "
                      f"{100 * f['sampled']['before']:.1f} -> "
                      f"{100 * f['sampled']['after']:.1f} % | {reach} | {f['train_s']:.0f} | "
                      f"{s['s_per_128_samples'][side]:.0f} |")
        if s["tta_ratio"] is not None:
            bound = " (at least: TRL did not reach the target within the budget)" \
                if s["tta_ratio_is_lower_bound"] else ""
            print(f"{task}: tta_ratio (TRL seconds to {100 * s['target']:.0f} % / grpolab's) = "
                  f"{s['tta_ratio']:.2f}{bound}; seconds per sample, TRL / grpolab = {s['speed_ratio']:.2f}")
    if args.plot and summary:
        plot(args.plot, results, summary)
        print(f"plot: {args.plot}")
    print(json.dumps({"machine": machine, "threads": args.threads, "samples": args.samples,
                      "eval_every": args.eval_every, "eval_n": args.eval_n,
                      "tta_ratio": {t: s["tta_ratio"] for t, s in summary.items()}, "summary": summary,
                      "curves": {t: {f"{side} seed {seed}": r["curve"] for (side, seed), r in rs.items()}
                                 for t, rs in results.items()}}))


if __name__ == "__main__":
    main()
