"""On-policy distillation against GRPO on the embedded task: held-out accuracy against samples drawn
(prints figures; not a test).

Per seed: ``grpolab demo --seed S`` gives the SFT start (``sft/final``, the student) and the
GRPO-trained model (``final``, the teacher). From the same SFT start, on the same budget of sampled
responses, two curves of validation accuracy (the task's validation split, ``--eval-examples``
questions at temperature 1, the same seeded draws at every point):

- ``grpo``: the demo's GRPO settings (128 responses per step), validated every ``--eval-every``
  steps;
- ``distill``: configs/distill_tiny.yaml's settings (64 responses per step, the sampled reverse KL
  to the teacher), validated at the same sample counts.

Figures per seed: the teacher's accuracy on the same questions, both curves (samples, accuracy),
and for each method the samples it took to come within ``--within`` of the teacher's accuracy
(null: not within the budget). The last line is one JSON object with every figure.

Usage: python benchmarks/distill.py [--seeds 0,1,2] [--budget 5120] [--eval-every-samples 640]
       [--eval-examples 200] [--within 0.03] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml

from grpolab.algorithms.distill import DistillConfig, train_distill
from grpolab.algorithms.grpo import GRPOConfig, train_grpo
from grpolab.data import get_task
from grpolab.eval import evaluate
from grpolab.experiments.demo import run_demo
from grpolab.experiments.presets import DEMO_GRPO, TASK, TASK_OPTIONS
from grpolab.models import load_model_and_tokenizer
from grpolab.rollout import make_backend
from grpolab.training.inputs import prompt_template_for
from grpolab.training.metric_logging import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def curve(metrics_path: Path, step_key: str, per_step: int) -> list[tuple[int, float]]:
    """(samples drawn, validation accuracy) at every validation of a run."""
    return [(r[step_key] * per_step, r["eval/accuracy"]) for r in read_metrics(metrics_path)
            if "eval/accuracy" in r and step_key in r]


def samples_to(points: list[tuple[int, float]], target: float) -> int | None:
    return next((n for n, acc in points if acc >= target), None)


def teacher_accuracy(path: Path, cfg: GRPOConfig, n: int) -> float:
    """The teacher's accuracy on the validation questions both curves are measured on."""
    model, tok = load_model_and_tokenizer(str(path))
    task = get_task(TASK, seed=cfg.seed, **TASK_OPTIONS)
    template = prompt_template_for(task, None, tokenizer=tok)
    return evaluate(make_backend("hf", model, tok), task.examples("validation", n), template, task.reward_fn,
                    cfg.eval_sampling_params()).metrics["accuracy"]


def one_seed(seed: int, args, out: Path) -> dict:
    t0 = time.perf_counter()
    demo = out / f"demo_{seed}"
    run_demo(demo, seed=seed, show_progress=False)
    common = dict(task=TASK, task_options=TASK_OPTIONS, seed=seed, device="cpu", show_progress=False,
                  eval_examples=args.eval_examples, log_generations_samples=0, model=str(demo / "sft" / "final"))
    grpo_per_step = DEMO_GRPO["rollout_batch_size"]
    grpo = GRPOConfig(**{**DEMO_GRPO, **common, "n_grpo_steps": args.budget // grpo_per_step,
                         "eval_every": args.eval_every_samples // grpo_per_step, "run_dir": str(out / f"grpo_{seed}")})
    tiny = yaml.safe_load((ROOT / "configs" / "distill_tiny.yaml").read_text())
    tiny.update(common, teacher=str(demo / "final"), run_dir=str(out / f"distill_{seed}"), checkpoint_every=0)
    per_step = tiny["rollout_batch_size"]
    tiny.update(n_distill_steps=args.budget // per_step, eval_every=args.eval_every_samples // per_step)
    distill = DistillConfig(**tiny)
    target = teacher_accuracy(demo / "final", grpo, args.eval_examples)
    t1 = time.perf_counter()
    grpo_result = train_grpo(grpo, overwrite=True)
    t2 = time.perf_counter()
    distill_result = train_distill(distill, overwrite=True)
    t3 = time.perf_counter()
    curves = {"grpo": curve(grpo_result.metrics_path, grpo.step_key, grpo_per_step),
              "distill": curve(distill_result.metrics_path, distill.step_key, per_step)}
    start = curves["grpo"][0][1] if curves["grpo"] and curves["grpo"][0][0] == 0 else None
    row = {"seed": seed, "teacher_accuracy": target, "start_accuracy": start, "curves": curves,
           "samples_to_teacher": {k: samples_to(v, target - args.within) for k, v in curves.items()},
           "seconds": {"demo": t1 - t0, "grpo": t2 - t1, "distill": t3 - t2}}
    print(f"seed {seed}: teacher {target:.3f}, start {start}, samples to within {args.within} of the teacher: "
          f"{row['samples_to_teacher']}, seconds {({k: round(v) for k, v in row['seconds'].items()})}", flush=True)
    for name, points in curves.items():
        print(f"  {name:8s}" + " ".join(f"{n}:{acc:.3f}" for n, acc in points), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=int, default=5120, help="sampled responses per method")
    parser.add_argument("--eval-every-samples", type=int, default=640)
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--within", type=float, default=0.03)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="grpolab-distill-"))
    rows = [one_seed(int(s), args, out) for s in args.seeds.split(",")]
    print(json.dumps({"budget": args.budget, "within": args.within, "eval_examples": args.eval_examples,
                      "seeds": rows}))


if __name__ == "__main__":
    main()
