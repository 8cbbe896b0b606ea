"""``grpolab demo``: the embedded tiny model gets measurably better at arithmetic through GRPO.

1. build the embedded ``tiny`` model (random init, character-level tokenizer);
2. warm it up with SFT on worked solutions of which ``WRONG_FRACTION`` are wrong (imperfect
   demonstrations: imitation alone reproduces their mistakes);
3. evaluate on held-out test questions (sampled at temperature 1, as CS336 evaluates);
4. run GRPO with the verifier's reward;
5. evaluate again and print the before/after table; write ``metrics.jsonl`` (GRPO), a plot,
   ``summary.json`` and ``final/`` (a Hugging Face model directory).

The demo is a self-contained job: running it again replaces its previous output in ``run_dir``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..algorithms.grpo import GRPOConfig, train_grpo
from ..algorithms.sft import SFTConfig, train_sft
from ..data import get_task
from ..eval import evaluate
from ..models import load_model_and_tokenizer
from ..rollout import SamplingParams, make_backend
from ..training.checkpoints import atomic_write_text, save_final
from ..training.health import UnhealthyRunError
from ..training.inputs import prompt_template_for
from ..training.metric_logging import plot_reward_curves
from .presets import DEMO_GRPO as GRPO
from .presets import DEMO_SFT as SFT
from .presets import TASK, TASK_OPTIONS, TEST_EXAMPLES

WRONG_FRACTION = TASK_OPTIONS["wrong_fraction"]
# GRPO stops when the health check finds no learning signal (every group all-wrong) for this many
# steps in a row, instead of training its whole budget on zero advantages
NO_SIGNAL_STEPS = 5


def no_signal_line(what: str, accuracy: float, flag: str) -> str:
    """The one line a demo prints when its warm start gives GRPO nothing to learn from."""
    return (f"grpolab demo: GRPO stopped after {NO_SIGNAL_STEPS} steps with no learning signal: every group's answers "
            f"all scored 0 (the SFT start solves {accuracy:.1%} of held-out {what}), so every advantage is 0. "
            f"Try a longer warm-up ({flag}) or another --seed.")


def _table(before: dict, after: dict) -> str:
    rows = [("answer accuracy", "accuracy", "{:.1%}"), ("format rate", "format_rate", "{:.1%}"),
            ("mean response length (tokens)", "mean_length", "{:.1f}")]
    lines = [f"{'held-out test set':32} {'SFT only':>10} {'SFT + GRPO':>11}"]
    for label, key, fmt in rows:
        lines.append(f"{label:32} {fmt.format(before[key]):>10} {fmt.format(after[key]):>11}")
    return "\n".join(lines)


def run_demo(run_dir: Path, seed: int = 0, sft_steps: int | None = None, grpo_steps: int | None = None,
             test_examples: int | None = None, show_progress: bool = True, dtype: str = "float32") -> dict:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    common = dict(task=TASK, task_options=TASK_OPTIONS, seed=seed, device="cpu", show_progress=show_progress,
                  dtype=dtype)

    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer("embedded:tiny", seed=seed)
    sft_cfg = SFTConfig(**{**SFT, **common, "run_dir": str(run_dir / "sft"), "eval_examples": 1,
                           "log_generations_samples": 0, "sampling_max_tokens": GRPO["sampling_max_tokens"]})
    if sft_steps is not None:
        sft_cfg = sft_cfg.model_copy(update={"n_sft_steps": sft_steps})
    print(f"[1/4] SFT warm-up on {WRONG_FRACTION:.0%}-wrong demonstrations ({sft_cfg.n_sft_steps} steps)")
    train_sft(sft_cfg, model=model, tokenizer=tokenizer, overwrite=True)
    timings["sft_s"] = time.perf_counter() - start

    task = get_task(TASK, seed=seed, **TASK_OPTIONS)
    test = task.examples("test", test_examples or TEST_EXAMPLES)
    template = prompt_template_for(task, None, tokenizer=tokenizer)  # the one place every command builds prompts
    sampling = SamplingParams(temperature=1.0, max_tokens=GRPO["sampling_max_tokens"], min_tokens=1,
                              stop=["</answer>"], seed=seed + 12345)

    def test_eval() -> dict:
        backend = make_backend("hf", model, tokenizer)
        return evaluate(backend, test, template, task.reward_fn, sampling).metrics

    t = time.perf_counter()
    print(f"[2/4] evaluating the SFT model on {len(test)} held-out test questions")
    before = test_eval()
    timings["eval_before_s"] = time.perf_counter() - t

    t = time.perf_counter()
    grpo_cfg = GRPOConfig(**{**GRPO, **common, "run_dir": str(run_dir / "grpo"), "health_window": NO_SIGNAL_STEPS,
                             "stop_on_unhealthy": ["zero_variance"]})
    if grpo_steps is not None:
        grpo_cfg = grpo_cfg.model_copy(update={"n_grpo_steps": grpo_steps})
    print(f"[3/4] GRPO ({grpo_cfg.n_grpo_steps} steps, {grpo_cfg.rollout_batch_size} rollouts each)")
    try:
        grpo_result = train_grpo(grpo_cfg, model=model, tokenizer=tokenizer, overwrite=True)
    except UnhealthyRunError:  # zero advantages left the weights as they were: the SFT figures stand
        stopped = no_signal_line("questions", before["accuracy"], f"--sft-steps {2 * SFT['n_sft_steps']}")
        print(stopped)
        timings.update(grpo_s=time.perf_counter() - t, total_s=time.perf_counter() - start)
        return _write_summary(run_dir, model, tokenizer, None, before, before, timings, seed, len(test), dtype,
                              stopped=stopped)
    timings["grpo_s"] = time.perf_counter() - t

    t = time.perf_counter()
    print("[4/4] evaluating the GRPO model on the same test questions")
    after = test_eval()
    timings["eval_after_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - start

    return _write_summary(run_dir, model, tokenizer, grpo_result, before, after, timings, seed, len(test), dtype)


def _write_summary(run_dir: Path, model, tokenizer, grpo_result, before: dict, after: dict, timings: dict, seed: int,
                   n_test: int, dtype: str, stopped: str | None = None) -> dict:
    """Save the final model and plot, write ``summary.json`` and print the table. ``stopped``: the
    line saying why GRPO stopped without a signal (then there is no GRPO result)."""
    final = save_final(model, tokenizer, run_dir / "final")
    metrics = run_dir / "grpo" / "metrics.jsonl" if grpo_result is None else grpo_result.metrics_path
    plot = plot_reward_curves(metrics, run_dir / "grpo_demo.png",
                              "grpolab demo: GRPO on the embedded tiny model (arithmetic)", "grpo_step")
    summary = {"grpo_stopped": stopped,
        "task": TASK, "task_options": TASK_OPTIONS, "seed": seed, "test_examples": n_test,
        "torch_threads": torch.get_num_threads(), "dtype": dtype,
        "before": before, "after": after,
        "accuracy_gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1),
        "wall_seconds": {k: round(v, 1) for k, v in timings.items()},
        "paths": {"run_dir": str(run_dir), "metrics": str(metrics), "plot": str(plot), "final": str(final)},
    }
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    print()
    print(_table(before, after))
    print(f"\naccuracy gain: {summary['accuracy_gain_points']:+.1f} points   wall time: {timings['total_s']:.0f} s "
          f"(SFT {timings['sft_s']:.0f} s, GRPO {timings['grpo_s']:.0f} s)")
    print(f"run directory: {run_dir}\nmetrics:       {metrics}\nplot:          {plot}\n"
          f"final model:   {final}\nsummary:       {run_dir / 'summary.json'}")
    return summary
