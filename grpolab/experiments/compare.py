"""``grpolab compare``: MLE (SFT), PPO and GRPO (expert iteration optional) trained from the same
warm start with the same sample budget, evaluated on the same held-out questions.

1. warm start: SFT of the embedded tiny model on imperfect demonstrations (as the demo);
2. each method continues from a copy of it, consuming ``budget`` samples: MLE reads ``budget``
   demonstrations, PPO and GRPO draw ``budget`` responses (EI too, when asked);
3. each is evaluated on the same test questions with ``k`` samples each: perplexity of the
   reference (correct) solutions, consistency, diversity, answer accuracy (pass@1), format rate;
4. ``report.md`` (the table), ``report.json`` (the same as data) and ``report.png`` (validation
   accuracy against samples consumed) go to the run directory.

With ``env`` (``grpolab compare --env FILE``: the keys of a config's ``env:``, e.g. the calculator),
every held-out evaluation samples through the tool environment (multi-turn, the share of answers
that called a tool reported per method) and GRPO trains with it; MLE, PPO and expert iteration
train as without it (only GRPO takes an environment).
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import torch

from ..algorithms.expert_iteration import EIConfig, train_expert_iteration
from ..algorithms.grpo import GRPOConfig, train_grpo
from ..algorithms.ppo import PPOConfig, train_ppo
from ..algorithms.sft import SFTConfig, train_sft
from ..data import get_task
from ..envs import EnvBackend, build_env
from ..eval.report import evaluate_model
from ..models import load_model_and_tokenizer, sum_response_log_probs
from ..rollout import make_backend
from ..training.checkpoints import atomic_write_text
from ..training.inputs import prompt_template_for
from ..training.metric_logging import read_metrics
from .presets import (
    COMPARE_EI,
    COMPARE_GRPO,
    COMPARE_MLE,
    COMPARE_PPO,
    DEMO_GRPO,
    DEMO_SFT,
    ROLLOUTS_PER_STEP,
    TASK,
    TASK_OPTIONS,
)


@torch.no_grad()
def reference_perplexity(model, tokenizer, prompts, responses, batch_size: int = 64) -> float:
    """exp(mean NLL per token) of reference responses given their prompts."""
    nll, count = 0.0, 0
    for i in range(0, len(prompts), batch_size):
        sums, counts = sum_response_log_probs(model, tokenizer, prompts[i : i + batch_size],
                                              responses[i : i + batch_size])
        nll -= float(sums.sum())
        count += int(counts.sum())
    return math.exp(nll / max(count, 1))


def _curve(metrics_path: Path, step_key: str, samples_per_step: int) -> list[tuple[int, float]]:
    return [(int(r[step_key]) * samples_per_step, r["eval/accuracy"]) for r in read_metrics(metrics_path)
            if "eval/accuracy" in r and step_key in r]


def _plot(curves: dict[str, list[tuple[int, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in curves.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    ax.set_xlabel("samples consumed (demonstrations or sampled responses)")
    ax.set_ylabel("validation answer accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("grpolab compare: same warm start, same sample budget")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def compare_methods(run_dir: Path, steps: int, common: dict, include_ei: bool, env: dict | None = None) -> dict:
    """Each method's (config, trainer, metrics step key, samples per step) for a budget of
    ``steps`` x 128 samples: MLE reads that many demonstrations, the RL methods draw that many
    responses."""
    budget = steps * ROLLOUTS_PER_STEP
    max_tokens, eval_every = DEMO_GRPO["sampling_max_tokens"], max(1, steps // 4)
    mle_steps = budget // DEMO_SFT["train_batch_size"]
    methods = {
        "MLE (SFT)": (
            SFTConfig(**{**DEMO_SFT, **common, **COMPARE_MLE, "run_dir": str(run_dir / "mle"), "n_sft_steps": mle_steps,
                         "eval_every": max(1, mle_steps // 4), "sampling_max_tokens": max_tokens}),
            train_sft,
            "sft_step",
            DEMO_SFT["train_batch_size"],
        ),
        "PPO": (
            PPOConfig(**{**common, **COMPARE_PPO, "run_dir": str(run_dir / "ppo"), "n_ppo_steps": steps,
                         "sampling_max_tokens": max_tokens, "eval_every": eval_every}),
            train_ppo,
            "ppo_step",
            ROLLOUTS_PER_STEP,
        ),
        "GRPO": (
            GRPOConfig(
                **{**DEMO_GRPO, **common, **COMPARE_GRPO, "run_dir": str(run_dir / "grpo"), "n_grpo_steps": steps,
                   "eval_every": eval_every, "env": env}
            ),
            train_grpo,
            "grpo_step",
            ROLLOUTS_PER_STEP,
        ),
    }
    if include_ei:
        ei_batch = budget // COMPARE_EI["n_ei_steps"] // COMPARE_EI["group_size"]
        methods["Expert iteration"] = (EIConfig(**{**common, **COMPARE_EI, "run_dir": str(run_dir / "ei"),
                                                   "ei_batch_size": ei_batch, "sampling_max_tokens": max_tokens}),
                                       train_expert_iteration, None, 0)
    return methods


def run_compare(run_dir: Path, seed: int = 0, steps: int = 100, k: int = 4, test_examples: int = 200,
                include_ei: bool = False, warm_steps: int | None = None, show_progress: bool = True,
                backend: str = "hf", env: dict | None = None) -> dict:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    budget = steps * ROLLOUTS_PER_STEP
    common = dict(task=TASK, task_options=TASK_OPTIONS, seed=seed, device="cpu", show_progress=show_progress)
    max_tokens = DEMO_GRPO["sampling_max_tokens"]

    print(f"[warm start] SFT on {TASK_OPTIONS['wrong_fraction']:.0%}-wrong demonstrations")
    t = time.perf_counter()
    base, tok = load_model_and_tokenizer("embedded:tiny", seed=seed)
    warm = SFTConfig(**{**DEMO_SFT, **common, "run_dir": str(run_dir / "warm_start"), "eval_examples": 1,
                        "log_generations_samples": 0, "sampling_max_tokens": max_tokens})
    if warm_steps is not None:
        warm = warm.model_copy(update={"n_sft_steps": warm_steps})
    train_sft(warm, model=base, tokenizer=tok, overwrite=True)
    warm_s = time.perf_counter() - t

    # held-out questions with correct worked solutions (the references for perplexity)
    task = get_task(TASK, seed=seed, **{**TASK_OPTIONS, "wrong_fraction": 0.0})
    test = task.examples("test", test_examples)
    template = prompt_template_for(task, None, tokenizer=tok)  # the one place every command builds prompts
    ref_prompts = [template.format(e.question) for e in test]
    ref_solutions = [e.solution for e in test]

    samplers = {}  # one evaluation sampler for the whole comparison (a vLLM engine is started once)

    def score(model, wall_s: float) -> dict:
        if "eval" not in samplers:
            samplers["eval"] = make_backend(backend, model, tok, seed=seed)
            if env is not None:  # multi-turn: the tools run around the same sampler
                samplers["eval"] = EnvBackend(samplers["eval"], build_env(**env, tokenizer=tok))
        sampler = samplers["eval"]
        sampler.sync_weights(model)
        metrics, _ = evaluate_model(model, tok, sampler, test, template, task.reward_fn,
                                    k=k, temperature=1.0, max_tokens=max_tokens, min_tokens=1, seed=seed + 777)
        return {
            "reference_perplexity": reference_perplexity(model, tok, ref_prompts, ref_solutions),
            "consistency": metrics["consistency"],
            "distinct_1": metrics["distinct_1"],
            "distinct_2": metrics["distinct_2"],
            "distinct_answers_per_question": metrics["distinct_answers_per_question"],
            "accuracy": metrics["accuracy"],
            f"maj@{k}": metrics[f"maj@{k}"],
            f"pass@{k}": metrics[f"pass@{k}"],
            "format_rate": metrics["format_rate"],
            "mean_length": metrics["mean_length"],
            "wall_s": round(wall_s, 1),
            **({"tool_call_rate": metrics["tool_call_rate"], "mean_tool_calls": metrics["mean_tool_calls"]}
               if env is not None else {}),
        }

    rows = {"SFT warm start": score(base, warm_s)}
    curves: dict[str, list[tuple[int, float]]] = {}
    methods = compare_methods(run_dir, steps, common, include_ei, env)
    for name, (cfg, train, step_key, samples_per_step) in methods.items():
        print(f"[{name}] {budget} samples")
        t = time.perf_counter()
        model = copy.deepcopy(base)
        res = train(cfg, model=model, tokenizer=tok, overwrite=True)
        rows[name] = score(model, time.perf_counter() - t)
        if step_key is not None:
            curves[name] = _curve(res.metrics_path, step_key, samples_per_step)

    for sampler in samplers.values():
        sampler.close()
    report = {"task": TASK, "task_options": TASK_OPTIONS, "seed": seed, "sample_budget": budget, "k": k,
              "test_questions": len(test), "env": env, "methods": rows, "curves": curves}
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2))
    atomic_write_text(run_dir / "report.md", format_report(report))
    _plot(curves, run_dir / "report.png")
    print()
    print(format_report(report))
    print(f"written: {run_dir / 'report.md'}, {run_dir / 'report.json'}, {run_dir / 'report.png'}")
    return report


def format_report(report: dict) -> str:
    k, tools = report["k"], report.get("env") is not None
    head = (
        "| method | ref. solution perplexity ↓ | consistency | distinct-1 | distinct-2 | distinct answers / question "
        f"| answer accuracy | maj@{k} | format rate |"
        + (" answers calling a tool |" if tools else "")
        + " wall time (s) |"
    )
    lines = [
        f"# grpolab compare — {report['task']}, seed {report['seed']}",
        "",
        f"Same warm start (SFT on demonstrations, {report['task_options']['wrong_fraction']:.0%} wrong), "
        f"same budget of {report['sample_budget']} samples per method, {report['test_questions']} held-out questions "
        f"x {k} samples at temperature 1.",
        "",
    ]
    if tools:
        lines += [f"Tool environment {report['env']}: every evaluation samples through it; GRPO trains with it.", ""]
    lines += [head, "|" + "---|" * (11 if tools else 10)]
    for name, r in report["methods"].items():
        tool_cell = f" {r['tool_call_rate']:.1%} |" if tools else ""
        lines.append(f"| {name} | {r['reference_perplexity']:.3f} | {r['consistency']:.3f} | {r['distinct_1']:.4f} | "
                     f"{r['distinct_2']:.4f} | {r['distinct_answers_per_question']:.2f} | {r['accuracy']:.1%} | "
                     f"{r[f'maj@{k}']:.1%} | {r['format_rate']:.1%} |{tool_cell} {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"
