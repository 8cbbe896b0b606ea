"""``grpolab compare --variants a,b,c --seeds N``: GRPO variants side by side, fairly.

For each seed: one SFT warm start on the demo's imperfect demonstrations (the demo's 400 steps);
then every variant (``presets.VARIANTS``: CS336 GRPO, Dr. GRPO, DAPO, GSPO, CISPO, RLOO,
REINFORCE++) continues from a copy of it with the same sample budget — ``steps x 128`` sampled
responses (60 steps by default), counting every response drawn, including those of groups dynamic
sampling drops — and is evaluated on the same held-out test questions. ``report.md``,
``report.json`` and ``report.png`` give, per variant: the final accuracy (mean ± std over seeds);
its gain over the warm start and its difference from ``grpo``, both paired by seed and marked
where the mean exceeds the seed-to-seed spread of that difference; validation accuracy at equal
wall time; the area under accuracy against samples; accuracy against samples consumed and against
wall time (mean with a min-max band over seeds), tokens trained, and groups dropped.

``model``: a local chat model instead (``presets.REAL_VARIANTS_GRPO``: two-digit addition in words,
the model's chat template, no warm start), for a short CPU budget.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

from ..algorithms.grpo import GRPOConfig, train_grpo
from ..algorithms.sft import SFTConfig, train_sft
from ..eval import evaluate
from ..models import load_model_and_tokenizer
from ..rollout import SamplingParams, make_backend
from ..training.checkpoints import atomic_write_text
from ..training.inputs import task_or_file
from ..training.metric_logging import read_metrics
from .presets import (
    DEMO_GRPO,
    DEMO_SFT,
    REAL_VARIANTS_GRPO,
    ROLLOUTS_PER_STEP,
    TASK,
    TASK_OPTIONS,
    VARIANTS,
    VARIANTS_STEPS,
    VARIANTS_WARM_STEPS,
)


def parse_variants(text: str) -> list[str]:
    """``--variants a,b,c``: known names, each once (one line otherwise, before anything trains)."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ValueError(
            f"unknown variant(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}"
        )
    check_distinct(names)
    return names


def check_distinct(variants: list[str]) -> None:
    """A variant named twice would train twice into the same directory and pair its seeds with
    themselves in the report: refused."""
    twice = sorted({v for v in variants if variants.count(v) > 1})
    if twice:
        raise ValueError(f"--variants names {', '.join(twice)} more than once; give each variant once")


def variant_config(name: str, run_dir: Path, steps: int, seed: int, show_progress: bool,
                   eval_examples: int = 100, overrides: dict | None = None, base: dict | None = None) -> GRPOConfig:
    """``base`` (the demo's GRPO run on the embedded task by default) with the variant's fields, stopped
    after ``steps x rollout_batch_size`` sampled responses. ``overrides`` (e.g. a smaller batch for a
    quick check) apply to every variant. Where the rollout batch is not the presets' 128, a variant's
    own ``train_batch_size`` is scaled with it (the same optimizer steps per rollout batch)."""
    overrides = overrides or {}
    fields = {**DEMO_GRPO, "task": TASK, "task_options": TASK_OPTIONS, **(base or {}), **VARIANTS[name], **overrides}
    rollouts = fields["rollout_batch_size"]
    if "train_batch_size" in VARIANTS[name] and "train_batch_size" not in overrides and rollouts != ROLLOUTS_PER_STEP:
        fields["train_batch_size"] = VARIANTS[name]["train_batch_size"] * rollouts // ROLLOUTS_PER_STEP
        fields["gradient_accumulation_steps"] = overrides.get("gradient_accumulation_steps", 1)
    fields.update({"seed": seed, "device": "cpu", "show_progress": show_progress, "run_dir": str(run_dir),
                   "max_rollout_samples": steps * fields["rollout_batch_size"],
                   "n_grpo_steps": steps * VARIANTS[name].get("max_sampling_rounds", 1),
                   "eval_every": max(1, steps // 5), "eval_examples": eval_examples, "log_generations_samples": 0})
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


def run_variants(run_dir: Path, variants: list[str], seeds: int = 3, steps: int = VARIANTS_STEPS,
                 warm_steps: int = VARIANTS_WARM_STEPS, test_examples: int = 200, show_progress: bool = True,
                 overrides: dict | None = None, model: str | None = None, data: str | None = None) -> dict:
    """Per seed one warm start (``warm_steps`` of the demo's SFT; 0: none), then every variant from
    a copy of it. ``model``: a local chat model with ``REAL_VARIANTS_GRPO``'s settings instead of the
    embedded model on the demo's task; ``data``: a reasoning-gym dataset (``rg:NAME``, its own
    ``score_answer`` as the reward) instead of the arithmetic task."""
    check_distinct(list(variants))
    if model is not None and warm_steps:
        raise ValueError("--warm-steps applies to the embedded model; --model starts from the model as it is")
    if data is not None and not data.startswith("rg:"):
        raise ValueError(f"--data with --variants takes a reasoning-gym dataset (rg:NAME), got {data!r}")
    if data is not None and warm_steps:
        raise ValueError("reasoning-gym items have no worked solutions to warm up on: use --warm-steps 0")
    if data is not None and model is None:
        raise ValueError("--data rg:NAME needs --model DIR: without a warm start the embedded model answers nothing "
                         "right, so every variant would stay at 0 %")
    run_dir = Path(run_dir)
    base = {**REAL_VARIANTS_GRPO, "model": model} if model is not None else {}
    if data is not None:
        base = {**base, "task": data, "task_options": {}, "reward": None, "system_prompt": None}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    warm_accuracy: list[float] = []
    for seed in range(seeds):
        start, tok = load_model_and_tokenizer(model or "embedded:tiny", seed=seed)
        cfg0 = variant_config(variants[0], run_dir, steps, seed, False, overrides=overrides, base=base)
        test, template, reward = task_or_file(f"task:{cfg0.task}", test_examples, prompt_template=cfg0.prompt_template,
                                              reward=cfg0.reward, task_options=cfg0.task_options, tokenizer=tok,
                                              system_prompt=cfg0.system_prompt)
        sampling = SamplingParams(temperature=cfg0.eval_temperature, max_tokens=cfg0.sampling_max_tokens, min_tokens=1,
                                  stop=cfg0.stop, seed=12345)

        def test_accuracy(m) -> float:
            return evaluate(make_backend("hf", m, tok), test, template, reward, sampling).metrics["accuracy"]

        if warm_steps:
            warm = SFTConfig(**{**DEMO_SFT, "task": TASK, "task_options": TASK_OPTIONS, "seed": seed,
                                "device": "cpu", "show_progress": show_progress, "n_sft_steps": warm_steps,
                                "eval_examples": 1, "log_generations_samples": 0,
                                "sampling_max_tokens": cfg0.sampling_max_tokens,
                                "run_dir": str(run_dir / f"seed{seed}" / "warm_start")})
            print(f"[seed {seed}] warm start: SFT {warm_steps} steps")
            train_sft(warm, model=start, tokenizer=tok, overwrite=True)
        warm_accuracy.append(test_accuracy(start))
        for name in variants:
            cfg = variant_config(name, run_dir / f"seed{seed}" / name, steps, seed, show_progress,
                                 min(100, test_examples), overrides, base)
            print(f"[seed {seed}] {name}: {cfg.max_rollout_samples} sampled responses")
            trained, t = copy.deepcopy(start), time.perf_counter()
            result = train_grpo(cfg, model=trained, tokenizer=tok, overwrite=True)
            wall = time.perf_counter() - t
            runs[name].append({"seed": seed, "accuracy": test_accuracy(trained), "wall_s": round(wall, 1),
                               **_curves(result.metrics_path)})
            del trained
    report = summarize(runs, seeds, cfg0.max_rollout_samples, len(test), warm_accuracy)
    report.update({"model": model or "embedded:tiny", "task": cfg0.task, "task_options": cfg0.task_options,
                   "warm_steps": warm_steps, "steps": steps})
    write_report(run_dir, report)
    return report


def paired(a: list[float], b: list[float]) -> dict:
    """``a - b`` seed by seed (the same warm start): the mean, its standard deviation over seeds, and
    whether the mean is larger than that spread (never with one seed: there is no spread to beat)."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    std = statistics.stdev(d) if len(d) > 1 else 0.0
    mean = statistics.fmean(d)
    return {"mean": mean, "std": std, "per_seed": d, "beyond_spread": len(d) > 1 and abs(mean) > std}


def curve_area(curve: list[tuple[float, float]]) -> float:
    """Area under accuracy against samples, over the samples' range: the mean accuracy during the run
    (trapezoids; one point: its accuracy)."""
    if len(curve) == 1 or curve[-1][0] == curve[0][0]:
        return curve[-1][1]
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(curve, curve[1:]))
    return area / (curve[-1][0] - curve[0][0])


def accuracy_at(curve: list[tuple[float, float]], t: float) -> float:
    """The last validation accuracy measured at or before wall time ``t`` (the first one if none was)."""
    return ([y for x, y in curve if x <= t] or [curve[0][1]])[-1]


def summarize(runs: dict[str, list[dict]], seeds: int, budget: int, n_test: int,
              warm_accuracy: list[float] | None = None) -> dict:
    baseline = "grpo" if "grpo" in runs else next(iter(runs))
    # equal wall time: where the variant that finished its budget soonest (mean over seeds) stopped
    equal_wall = min(statistics.fmean(r["wall"][-1][0] for r in per_seed) for per_seed in runs.values())
    table = {}
    for name, per_seed in runs.items():
        acc = [r["accuracy"] for r in per_seed]
        table[name] = {"accuracy_mean": statistics.fmean(acc),
                       "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                       "vs_baseline": paired(acc, [r["accuracy"] for r in runs[baseline]]),
                       "accuracy_at_equal_wall": statistics.fmean(accuracy_at(r["wall"], equal_wall) for r in per_seed),
                       "curve_area": statistics.fmean(curve_area(r["samples"]) for r in per_seed),
                       "wall_s_mean": statistics.fmean(r["wall_s"] for r in per_seed),
                       "tokens_trained_mean": statistics.fmean(r["tokens_trained"] for r in per_seed),
                       "groups_dropped_mean": statistics.fmean(r["groups_dropped"] for r in per_seed)}
        if warm_accuracy:
            table[name]["gain_over_warm_start"] = paired(acc, warm_accuracy)
    return {"seeds": seeds, "sample_budget": budget, "test_questions": n_test, "baseline": baseline,
            "equal_wall_s": equal_wall, "variants": table, "runs": runs, "warm_start_accuracy": warm_accuracy or []}


def _difference(p: dict) -> str:
    return f"{p['mean'] * 100:+.1f} ± {p['std'] * 100:.1f}{' *' if p['beyond_spread'] else ''}"


def format_report(report: dict) -> str:
    base = report["baseline"]
    seeds = f"{report['seeds']} seed{'s' if report['seeds'] != 1 else ''}"
    lines = [f"# grpolab compare --variants — {report['task']} ({report['model']}), {seeds}", "",
             f"Each seed: one warm start ({report['warm_steps']} SFT steps); every variant continues from it with a "
             f"budget of {report['sample_budget']} sampled responses; final accuracy on {report['test_questions']} "
             "held-out questions (1 sample each), at equal samples. Differences are paired by seed (the same warm "
             "start), in points: mean ± std over seeds, * where the mean exceeds that spread (a screen, not a "
             "significance test: with 3 seeds it is t > 1.73). Accuracy at equal wall time: the last validation "
             f"accuracy measured by {report['equal_wall_s']:.0f} s, when the fastest variant had spent its budget; "
             "area: mean validation accuracy over the run (area under accuracy against samples).", "",
             f"| variant | final accuracy (mean ± std) | gain over warm start (points) | vs {base} (points) | "
             f"accuracy at {report['equal_wall_s']:.0f} s | area | wall time (s) | tokens trained | groups dropped |",
             "|---|---|---|---|---|---|---|---|---|"]
    warm = report.get("warm_start_accuracy") or []
    if warm:
        std = statistics.stdev(warm) if len(warm) > 1 else 0.0
        lines.append(f"| (warm start) | {statistics.fmean(warm):.1%} ± {std:.1%} | | | | | | | |")
    for name, r in report["variants"].items():
        gain = _difference(r["gain_over_warm_start"]) if "gain_over_warm_start" in r else ""
        versus = "—" if name == base else _difference(r["vs_baseline"])
        lines.append(f"| {name} | {r['accuracy_mean']:.1%} ± {r['accuracy_std']:.1%} | {gain} | {versus} | "
                     f"{r['accuracy_at_equal_wall']:.1%} | {r['curve_area']:.1%} | {r['wall_s_mean']:.0f} | "
                     f"{r['tokens_trained_mean']:,.0f} | {r['groups_dropped_mean']:.0f} |")
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, report: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2))
    atomic_write_text(run_dir / "report.md", format_report(report))
    _plot(report, run_dir / "report.png")
    written = f"written: {run_dir / 'report.md'}, {run_dir / 'report.json'}, {run_dir / 'report.png'}"
    print("\n" + format_report(report) + written)


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
