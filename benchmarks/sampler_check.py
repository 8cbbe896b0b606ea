"""Do grpolab's sampler and TRL's (Hugging Face ``generate``) draw the same replies? (prints figures;
not a test). ``benchmarks/first_update.py`` shows that, given the same completions, the two sides take
the same update; this script checks the other half of a time-to-accuracy comparison: the completions.

On a ``real_tta.py`` task's training questions (``--task``, default arithmetic), from the same
SmolLM2-135M-Instruct, it samples ``--questions`` x ``--n`` replies twice:

- grpolab: ``HFRolloutBackend.generate`` (the fast decoder the GRPO run uses), T, top-p 1, 1-24 new
  tokens, stop at the first newline;
- TRL: ``model.generate`` with the ``GenerationConfig`` and end ids of a TRL 1.16 ``GRPOTrainer`` built
  from ``real_tta.trl_config`` (every token holding a newline an end id, ``min_new_tokens`` 1);

and prints, for each, the reward rate (mean and standard error over questions), the share of groups with
a reward variance (the groups that train), the mean reply length, and for grpolab the largest difference
between the sampler's recorded log-probs and a teacher-forced forward (the sampled distribution is the
one the trainer scores). Two samplers that draw from the same distribution give reward rates within a
few standard errors.

Usage: OMP_NUM_THREADS=2 .venv-bench/bin/python benchmarks/sampler_check.py [--questions 64] [--n 8]
       [--seeds 0,1] [--task arithmetic] [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def summary(rewards: list[list[float]], lengths: list[int]) -> dict:
    per_q = [sum(r) / len(r) for r in rewards]
    mean = sum(per_q) / len(per_q)
    var = sum((p - mean) ** 2 for p in per_q) / max(1, len(per_q) - 1)
    return {"reward": mean, "se": math.sqrt(var / len(per_q)),
            "groups_with_variance": sum(0 < p < 1 for p in per_q) / len(per_q),
            "length": sum(lengths) / len(lengths)}


def grpolab_side(model, tok, prompts, answers, scorer, cfg, n, seed):
    import torch

    from grpolab.rollout.base import SamplingParams
    from grpolab.rollout.hf import HFRolloutBackend

    backend = HFRolloutBackend(model, tok, generator=torch.Generator().manual_seed(seed))
    sampling = SamplingParams(temperature=cfg.sampling_temperature, max_tokens=cfg.sampling_max_tokens,
                              min_tokens=cfg.sampling_min_tokens, stop=list(cfg.stop))
    rollouts = backend.generate(prompts, n, sampling)
    scores = scorer.score([r.response for r in rollouts], [answers[r.prompt_index] for r in rollouts])
    rewards = [[] for _ in prompts]
    for r, s in zip(rollouts, scores, strict=True):
        rewards[r.prompt_index].append(s["reward"])
    # the recorded log-probs against a teacher-forced forward of the same ids, one row at a time
    worst = 0.0
    with torch.no_grad():
        for r in rollouts[:64]:
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float() / cfg.sampling_temperature
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
            worst = max(worst, float((lp - torch.tensor(r.logprobs)).abs().max()))
    return {**summary(rewards, [len(r.response_ids) for r in rollouts]), "logprob_max_diff": worst}


def trl_side(model, tok, prompts, answers, scorer, cfg, n, seed):
    import tempfile

    import real_tta
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    real_tta.end_at_newline(model, tok)
    with tempfile.TemporaryDirectory() as out:  # TRL's own GenerationConfig and end ids, not a copy of them
        trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=real_tta.trl_config(cfg, seed, "float32", out, max_steps=1),
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    gen, ends = trainer.generation_config, list(trainer.eos_token_ids)
    torch.manual_seed(seed)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rewards, lengths = [[] for _ in prompts], []
    for start in range(0, len(prompts), 8):  # 8 questions x n rows per generate call, as a TRL batch would
        chunk = [p for p in prompts[start:start + 8] for _ in range(n)]
        enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, generation_config=gen)
        completion = out[:, enc["input_ids"].shape[1]:]
        is_end = torch.isin(completion, torch.tensor(ends))
        texts = []
        for row, ended in zip(completion, is_end, strict=True):
            stop = int(ended.nonzero()[0]) + 1 if ended.any() else len(row)
            lengths.append(stop)
            texts.append(tok.decode(row[:stop], skip_special_tokens=True))
        scores = scorer.score(texts, [answers[start + i // n] for i in range(len(chunk))])
        for i, s in enumerate(scores):
            rewards[start + i // n].append(s["reward"])
    return summary(rewards, lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--task", default="arithmetic", help="a real_tta.py task: arithmetic or basic_arithmetic")
    ap.add_argument("--temperature", type=float, default=None, help="default: the config's (0.7)")
    args = ap.parse_args()

    import real_tta
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpolab.rewards import RewardScorer
    from grpolab.training.inputs import load_inputs

    model_dir = str(Path("~/.cache/grpolab/SmolLM2-135M-Instruct").expanduser())
    tta_args = argparse.Namespace(model=model_dir, threads=torch.get_num_threads(), dtype="float32", samples=1024)
    cfg = real_tta.task_config(tta_args, args.task, 0, "unused")
    if args.temperature is not None:
        cfg.sampling_temperature = args.temperature
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = load_inputs(cfg, tok)
    examples = inputs.train[:args.questions]
    prompts = [inputs.template.format(e.question) for e in examples]
    answers = [e.answer for e in examples]
    scorer = RewardScorer(inputs.reward, timeout_s=cfg.reward_timeout_s, num_workers=1, device="cpu")
    figures = {}
    try:
        for seed in (int(s) for s in args.seeds.split(",")):
            for side, fn in (("grpolab", grpolab_side), ("trl", trl_side)):
                figures[f"{side}/{seed}"] = result = fn(model, tok, prompts, answers, scorer, cfg, args.n, seed)
                print(f"seed {seed} {side:8s} reward {result['reward']:.3f} ± {result['se']:.3f}, groups with a "
                      f"variance {result['groups_with_variance']:.2f}, length {result['length']:.1f}"
                      + (f", log-prob vs forward {result['logprob_max_diff']:.1e}" if "logprob_max_diff" in result
                         else ""), flush=True)
    finally:
        scorer.close()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
