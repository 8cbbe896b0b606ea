"""``grpolab compare --variants a,b,c --seeds N``: GRPO variants side by side, fairly.

For each seed: one SFT warm start on the demo's imperfect demonstrations; then every variant
(``presets.VARIANTS``: CS336 GRPO, Dr. GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++) continues from
a copy of it with the same sample budget — ``steps x 128`` sampled responses, counting every
response drawn, including those of groups dynamic sampling drops — and is evaluated on the same
held-out test questions. ``report.md``, ``report.json`` and ``report.png`` give, per variant, the
final accuracy (mean ± std over seeds), accuracy against samples consumed and against wall time
(mean with a min-max band over seeds), tokens trained, and groups dropped.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

from .algorithms.checkpoints import atomic_write_text
from .algorithms.grpo import GRPOConfig, train_grpo
from .algorithms.metrics import read_metrics
from .algorithms.sft import SFTConfig, train_sft
from .algorithms.inputs import prompt_template_for
from .data import get_task
from .eval import evaluate
from .models import load_model_and_tokenizer
from .presets import DEMO_GRPO, DEMO_SFT, ROLLOUTS_PER_STEP, TASK, TASK_OPTIONS, VARIANTS
from .rollout import SamplingParams, make_backend


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"unknown variant(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    return names


def variant_config(name: str, run_dir: Path, steps: int, seed: int, show_progress: bool,
                   eval_examples: int = 100, overrides: dict | None = None) -> GRPOConfig:
    """The demo's GRPO run with the variant's fields, stopped after ``steps x rollout_batch_size``
    (128) sampled responses. ``overrides`` (e.g. a smaller batch for a quick check) apply to every variant."""
    overrides = overrides or {}
    budget = steps * overrides.get("rollout_batch_size", ROLLOUTS_PER_STEP)
    fields = {**DEMO_GRPO, **VARIANTS[name], **overrides, "task": TASK, "task_options": TASK_OPTIONS, "seed": seed, "device": "cpu",
              "show_progress": show_progress, "run_dir": str(run_dir), "max_rollout_samples": budget,
              "n_grpo_steps": steps * VARIANTS[name].get("max_sampling_rounds", 1), "eval_every": max(1, steps // 5),
              "eval_examples": eval_examples, "log_generations_samples": 0}
    return GRPOConfig(**fields)


def _curves(metrics_path: Path) -> dict[str, list]:
    """(samples consumed, accuracy) and (wall seconds, accuracy) at each validation."""
    records = read_metrics(metrics_path)
    drawn = {r["grpo_step"]: r["train/samples_drawn"] for r in records if "train/samples_drawn" in r}
    evals = [r for r in records if "eval/accuracy" in r]
    samples = [(drawn.get(r["grpo_step"] - 1, 0), r["eval/accuracy"]) for r in evals]
    wall = [(r["time/elapsed_s"], r["eval/accuracy"]) for r in evals]
    tokens = sum(r.get("train/tokens_trained", 0) for r in records)
    dropped = sum(r.get("sampling/groups_dropped", 0) for r in records)
    return {"samples": samples, "wall": wall, "tokens_trained": tokens, "groups_dropped": dropped}


def run_variants(run_dir: Path, variants: list[str], seeds: int = 3, steps: int = 40, warm_steps: int = 200,
                 test_examples: int = 200, show_progress: bool = True, overrides: dict | None = None) -> dict:
    run_dir = Path(run_dir)
    task = get_task(TASK, seed=0, **TASK_OPTIONS)
    test, template = task.examples("test", test_examples), prompt_template_for(task, None)  # the embedded model's
    sampling = SamplingParams(temperature=1.0, max_tokens=DEMO_GRPO["sampling_max_tokens"], min_tokens=1,
                              stop=["</answer>"], seed=12345)
    per_step = (overrides or {}).get("rollout_batch_size", ROLLOUTS_PER_STEP)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    warm_accuracy: list[float] = []
    for seed in range(seeds):
        base, tok = load_model_and_tokenizer("embedded:tiny", seed=seed)
        warm = SFTConfig(**{**DEMO_SFT, "task": TASK, "task_options": TASK_OPTIONS, "seed": seed, "device": "cpu",
                            "show_progress": show_progress, "n_sft_steps": warm_steps, "eval_examples": 1,
                            "log_generations_samples": 0, "sampling_max_tokens": DEMO_GRPO["sampling_max_tokens"],
                            "run_dir": str(run_dir / f"seed{seed}" / "warm_start")})
        print(f"[seed {seed}] warm start: SFT {warm_steps} steps")
        train_sft(warm, model=base, tokenizer=tok, overwrite=True)
        warm_accuracy.append(evaluate(make_backend("hf", base, tok), test, template, task.reward_fn, sampling).metrics["accuracy"])
        for name in variants:
            print(f"[seed {seed}] {name}: {steps * per_step} sampled responses")
            model, t = copy.deepcopy(base), time.perf_counter()
            cfg = variant_config(name, run_dir / f"seed{seed}" / name, steps, seed, show_progress, min(100, test_examples),
                                 overrides)
            result = train_grpo(cfg, model=model, tokenizer=tok, overwrite=True)
            wall = time.perf_counter() - t
            accuracy = evaluate(make_backend("hf", model, tok), test, template, task.reward_fn, sampling).metrics["accuracy"]
            runs[name].append({"seed": seed, "accuracy": accuracy, "wall_s": round(wall, 1), **_curves(result.metrics_path)})
    report = summarize(runs, seeds, steps * per_step, len(test))
    report["warm_start_accuracy"] = warm_accuracy
    write_report(run_dir, report)
    return report


def summarize(runs: dict[str, list[dict]], seeds: int, budget: int, n_test: int) -> dict:
    table = {}
    for name, per_seed in runs.items():
        acc = [r["accuracy"] for r in per_seed]
        table[name] = {"accuracy_mean": statistics.fmean(acc), "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                       "wall_s_mean": statistics.fmean(r["wall_s"] for r in per_seed),
                       "tokens_trained_mean": statistics.fmean(r["tokens_trained"] for r in per_seed),
                       "groups_dropped_mean": statistics.fmean(r["groups_dropped"] for r in per_seed)}
    return {"task": TASK, "task_options": TASK_OPTIONS, "seeds": seeds, "sample_budget": budget,
            "test_questions": n_test, "variants": table, "runs": runs}


def format_report(report: dict) -> str:
    lines = [f"# grpolab compare --variants — {report['task']}, {report['seeds']} seeds", "",
             f"Each seed: one SFT warm start; every variant continues from it with a budget of {report['sample_budget']} "
             f"sampled responses; final accuracy on {report['test_questions']} held-out questions (1 sample each, T = 1).",
             "", "| variant | final accuracy (mean ± std) | wall time (s) | tokens trained | groups dropped |",
             "|---|---|---|---|---|"]
    warm = report.get("warm_start_accuracy") or []
    if warm:
        std = statistics.stdev(warm) if len(warm) > 1 else 0.0
        lines.append(f"| (SFT warm start) | {statistics.fmean(warm):.1%} ± {std:.1%} | | | |")
    for name, r in report["variants"].items():
        lines.append(f"| {name} | {r['accuracy_mean']:.1%} ± {r['accuracy_std']:.1%} | {r['wall_s_mean']:.0f} | "
                     f"{r['tokens_trained_mean']:,.0f} | {r['groups_dropped_mean']:.0f} |")
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, report: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2))
    atomic_write_text(run_dir / "report.md", format_report(report))
    _plot(report, run_dir / "report.png")
    print("\n" + format_report(report) + f"written: {run_dir / 'report.md'}, {run_dir / 'report.json'}, {run_dir / 'report.png'}")


def _band(series: list[list[tuple[float, float]]]):
    """Mean and min-max of accuracy at each validation index across seeds (x: the mean x)."""
    n = min(len(s) for s in series)
    xs = [statistics.fmean(s[i][0] for s in series) for i in range(n)]
    ys = [[s[i][1] for s in series] for i in range(n)]
    return xs, [statistics.fmean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def _plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, per_seed in report["runs"].items():
        for ax, key in zip(axes, ("samples", "wall")):
            xs, mean, low, high = _band([r[key] for r in per_seed])
            line, = ax.plot(xs, mean, "o-", label=name, markersize=3)
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("sampled responses")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes:
        ax.set_ylabel("validation accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"GRPO variants: mean and min-max over {report['seeds']} seeds")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
