"""The same GRPO step with Hugging Face TRL's GRPOTrainer, for a same-machine reference.

Not a dependency of grpolab: run it where TRL is installed (``pip install trl==1.16.0``), e.g.
``python benchmarks/trl_grpo_step.py --sizes tiny,small``. Same shapes as ``grpo_step.py``: the
embedded models (random init), 8 prompts x 8 generations = 64 completions per optimizer step, up to
8 new tokens, on-policy (one iteration), no reference model (beta 0), fp32 on the CPU. The time of
each optimizer step is taken by a trainer callback; the first steps are warm-up and not counted.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def measure(size: str, steps: int, warmup: int = 2) -> dict:
    import grpo_step  # same prompts and reward as the grpolab benchmark
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpolab.models import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model(size, tok, seed=0)
    data = Dataset.from_dict({"prompt": grpo_step.PROMPTS * (steps + warmup + 2)})

    def reward(completions, **kwargs):
        return [grpo_step.reward(c) for c in completions]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=64, num_generations=grpo_step.GROUP,
                         max_completion_length=grpo_step.MAX_NEW, gradient_accumulation_steps=1, beta=0.0,
                         num_iterations=1, learning_rate=1e-5, temperature=1.0, max_steps=steps + warmup,
                         logging_steps=10_000, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                         shuffle_dataset=False, disable_dropout=True)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=data,
                              processing_class=tok, callbacks=[Timer()])
        trainer.train()
    counted = times[warmup:]
    s = sum(counted) / len(counted)
    return {"size": size, "steps": len(counted), "s_per_step": round(s, 4), "completions_per_s": round(64 / s, 1)}


def main() -> None:
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [measure(size, args.steps) for size in args.sizes.split(",")]
    for r in results:
        print(f"TRL GRPOTrainer {r['size']:5} fp32: {r['completions_per_s']:7.1f} completions/s ({r['s_per_step']} "
              "s/step)")
    print(json.dumps({"trl": results}))


if __name__ == "__main__":
    main()
