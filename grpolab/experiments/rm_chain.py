"""The learned-reward chain, measured: ``python -m grpolab.experiments.rm_chain --run-dir runs/rm_chain``.

On the embedded arithmetic task (the demo's settings):

1. SFT warm start on demonstrations of which half end in a wrong answer (the demo's ``sft`` phase);
2. ``grpolab rm``: a reward model — the SFT model with a value head — trained with Bradley–Terry on
   preference pairs written from the task (``pairs.jsonl``): a correct worked solution preferred to
   the same steps with a wrong final answer (``negatives``: ``step`` adds pairs whose rejected
   solution has one step off, carried to a consistent answer — which this RM does not learn in
   minutes); its pairwise accuracy on held-out test pairs;
3. GRPO against the reward model alone, with a KL penalty to the SFT policy (``kl_coef``, 0.5: the
   InstructGPT recipe against over-optimisation; without it the policy games the RM within 25
   steps): the reward is the RM's score (batch-normalised); the task's verifier is in the weighted
   list with weight 0, so it is logged beside it (``train/reward_verifier``) but never trained on,
   and validation accuracy is the verifier's;
4. held-out test accuracy (the verifier's) before and after, and what the run's figures say about
   reward hacking: the RM's score against the verifier's on the same rollouts, response length, how
   often the RM ranks a right answer above a wrong one of the same group
   (``health/reward_answer_agreement``), and the health checks' messages.

Everything is written under ``run_dir`` (``sft/``, ``rm/``, ``grpo/``, ``summary.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from ..algorithms.grpo import GRPOConfig, train_grpo
from ..algorithms.rm import RMConfig, pairwise_accuracy, train_rm
from ..algorithms.sft import SFTConfig, train_sft
from ..data import get_task, load_preferences
from ..eval import evaluate
from ..models import load_model_and_tokenizer
from ..models.classifier import load_sequence_classifier
from ..rollout import SamplingParams, make_backend
from ..training.checkpoints import atomic_write_text
from ..training.inputs import prompt_template_for
from ..training.metric_logging import read_metrics
from .presets import DEMO_GRPO, DEMO_SFT, TASK, TASK_OPTIONS, TEST_EXAMPLES

# the RM: Bradley-Terry on task pairs, from the SFT model's backbone
CHAIN_RM = dict(n_rm_steps=300, learning_rate=1e-3, train_batch_size=32, task_train_size=3000, eval_pairs=200,
                eval_every=50, warmup_steps=20, lr_schedule="cosine")
CHAIN_KL_COEF = 0.5  # GRPO's KL penalty to the SFT policy (k3, as a loss term)


def rm_reward(rm_dir: str | Path, normalize: str = "batch") -> list[dict]:
    """GRPO's reward: the reward model alone, plus the verifier at weight 0 (logged, not trained on)."""
    return [{"model": str(rm_dir), "normalize": normalize, "name": "rm"},
            {"fn": "arithmetic", "weight": 0.0, "key": "answer_reward", "name": "verifier"}]


def write_pairs(path: Path, task, template, split: str, n: int, negatives: tuple[str, ...], seed: int) -> str:
    """``n`` preference pairs of ``split`` as DPO/RM JSONL: the correct worked solution over a wrong
    one, the wrong kind cycling through ``negatives`` (``answer``, ``step``)."""
    rng = random.Random(f"rm_chain:{seed}:{split}")
    with open(path, "w", encoding="utf-8") as f:
        for i, e in enumerate(task.examples(split, n)):
            rejected = task.wrong_solution(e, rng, negatives[i % len(negatives)])
            f.write(
                json.dumps({"prompt": template.format(e.question), "chosen": e.solution, "rejected": rejected}) + "\n"
            )
    return str(path)


def run_rm_chain(run_dir: Path, seed: int = 0, sft_steps: int | None = None, rm_steps: int | None = None,
                 grpo_steps: int | None = None, test_examples: int = TEST_EXAMPLES, show_progress: bool = True,
                 sft_overrides: dict | None = None, rm_overrides: dict | None = None,
                 grpo_overrides: dict | None = None, negatives: tuple[str, ...] = ("answer",),
                 sft_dir: str | None = None) -> dict:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    common = dict(task=TASK, task_options=TASK_OPTIONS, seed=seed, device="cpu", show_progress=show_progress)
    wall: dict[str, float] = {}

    t = time.perf_counter()
    if sft_dir is None:  # the demo's warm start
        model, tok = load_model_and_tokenizer("embedded:tiny", seed=seed)
        sft = SFTConfig(**{**DEMO_SFT, **common, "run_dir": str(run_dir / "sft"), "eval_examples": 1,
                           "log_generations_samples": 0, "sampling_max_tokens": DEMO_GRPO["sampling_max_tokens"],
                           **({"n_sft_steps": sft_steps} if sft_steps else {}), **(sft_overrides or {})})
        sft_dir = str(train_sft(sft, model=model, tokenizer=tok, overwrite=True).final_dir)
    model, tok = load_model_and_tokenizer(sft_dir)
    wall["sft_s"] = time.perf_counter() - t

    t = time.perf_counter()
    task = get_task(TASK, seed=seed, **{**TASK_OPTIONS, "wrong_fraction": 0.0})
    template = prompt_template_for(task, None, tokenizer=tok)
    rm_options = {**CHAIN_RM, **({"n_rm_steps": rm_steps} if rm_steps else {}), **(rm_overrides or {})}
    pairs = {split: write_pairs(run_dir / f"pairs_{split}.jsonl", task, template, split, n, negatives, seed)
             for split, n in (("train", rm_options.pop("task_train_size")), ("validation", rm_options["eval_pairs"]),
                              ("test", test_examples))}
    rm_cfg = RMConfig(**{**rm_options, "seed": seed, "device": "cpu", "show_progress": show_progress,
                         "model": sft_dir, "train_data": pairs["train"], "eval_data": pairs["validation"],
                         "run_dir": str(run_dir / "rm")})
    rm_result = train_rm(rm_cfg, overwrite=True)
    wall["rm_s"] = time.perf_counter() - t

    test = get_task(TASK, seed=seed, **TASK_OPTIONS).examples("test", test_examples)  # the demo's test questions
    rm_model, rm_tok = load_sequence_classifier(str(rm_result.final_dir))
    test_pairs = list(load_preferences(pairs["test"]))
    rm_test = pairwise_accuracy(rm_model.eval(), rm_tok, test_pairs, rm_cfg, "cpu")
    rm_test_by_kind = {kind: pairwise_accuracy(rm_model, rm_tok, test_pairs[i :: len(negatives)], rm_cfg, "cpu")
                       ["pairwise_accuracy"] for i, kind in enumerate(negatives)}
    sampling = SamplingParams(temperature=1.0, max_tokens=DEMO_GRPO["sampling_max_tokens"], min_tokens=1,
                              stop=["</answer>"], seed=seed + 12345)

    def test_eval() -> dict:
        return evaluate(make_backend("hf", model, tok), test, template, task.reward_fn, sampling).metrics

    before = test_eval()
    t = time.perf_counter()
    grpo = GRPOConfig(**{**DEMO_GRPO, **common, "run_dir": str(run_dir / "grpo"),
                         "reward": rm_reward(rm_result.final_dir), "kl_coef": CHAIN_KL_COEF,
                         **({"n_grpo_steps": grpo_steps} if grpo_steps else {}), **(grpo_overrides or {})})
    grpo_result = train_grpo(grpo, model=model, tokenizer=tok, overwrite=True)
    wall["grpo_s"] = time.perf_counter() - t
    after = test_eval()

    summary = {
        "task": TASK,
        "task_options": TASK_OPTIONS,
        "seed": seed,
        "test_examples": len(test),
        "kl_coef": grpo.kl_coef,
        "negatives": list(negatives),
        "rm_validation": {"before": rm_result.before, "after": rm_result.after},
        "rm_test": rm_test,
        "rm_test_by_kind": rm_test_by_kind,
        "before": before,
        "after": after,
        "hacking": hacking_figures(grpo_result.metrics_path),
        "wall_seconds": {k: round(v, 1) for k, v in wall.items()},
    }
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def hacking_figures(metrics_path: Path, window: int = 10) -> dict:
    """The RM's score and the verifier's on the same training rollouts, and the response length,
    over the first and the last ``window`` GRPO steps; validation accuracy (verifier) per evaluation."""
    records = read_metrics(metrics_path)
    rows = [r for r in records if "train/reward_rm_raw" in r]
    evals = [(r["grpo_step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]

    first, last = rows[:window], rows[-window:]
    keys = {"rm_raw": "train/reward_rm_raw", "verifier": "train/reward_verifier", "length": "train/response_length",
            "format": "train/format_reward", "agreement": "health/reward_answer_agreement"}

    def mean(part, key):
        part = [r[key] for r in part if key in r]  # agreement: only steps with a (right, wrong) pair
        return sum(part) / len(part) if part else None

    return {"first": {k: mean(first, v) for k, v in keys.items()}, "last": {k: mean(last, v) for k, v in keys.items()},
            "validation_accuracy": evals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/rm_chain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int)
    parser.add_argument("--rm-steps", type=int)
    parser.add_argument("--grpo-steps", type=int)
    parser.add_argument("--test-examples", type=int, default=TEST_EXAMPLES)
    parser.add_argument("--negatives", default="answer", help="wrong kinds of the rejected solutions (answer, step)")
    parser.add_argument("--kl-coef", type=float, default=CHAIN_KL_COEF, help="GRPO's KL penalty to the SFT policy")
    parser.add_argument("--sft-dir", help="start from this SFT model instead of training the warm start")
    parser.add_argument("--rm-lr", type=float, help=f"the RM's learning rate (default {CHAIN_RM['learning_rate']})")
    args = parser.parse_args()
    summary = run_rm_chain(Path(args.run_dir), args.seed, args.sft_steps, args.rm_steps, args.grpo_steps,
                           args.test_examples, negatives=tuple(args.negatives.split(",")), sft_dir=args.sft_dir,
                           rm_overrides={"learning_rate": args.rm_lr} if args.rm_lr else None,
                           grpo_overrides={"kl_coef": args.kl_coef})
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
