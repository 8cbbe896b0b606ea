"""GRPO step speed on the embedded tiny and small models (prints figures; not a test).

Each optimizer step: 64 completions (8 prompts x group 8) of up to 8 new tokens, on-policy, no
reference model, reward = "the first character has an even code" (random-init models: about half the
responses score 1, so skipping zero-advantage rows saves little; both figures are shown). For each
size and dtype we time grpolab's step (rollout with the KV-cache sampling loop, then the
micro-batched update) with and without skipping rows whose gradient is exactly zero, and a plain
baseline in the same process: Hugging Face ``generate`` (sampling, scores kept) followed by one
forward+backward over the padded batch — the cost that TRL's GRPOTrainer is within ~10 % of on these
shapes. For TRL itself on the same machine and shapes, run ``benchmarks/trl_grpo_step.py`` where
``trl`` is installed (it is not a grpolab dependency). Figures quoted in the issue for TRL 1.16:
tiny 590 completions/s; a 34M Qwen2 36.6/s fp32, ~52/s bf16.

Usage: python benchmarks/grpo_step.py [--steps N] [--sizes tiny,small] [--dtypes float32,bfloat16]
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import time

import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.algorithms.grpo_update import accumulate_policy_gradient
from grpolab.core import normalize_group_rewards
from grpolab.models import build_char_tokenizer, build_tiny_model
from grpolab.rollout import HFRolloutBackend, SamplingParams
from grpolab.training.batching import make_rollout_batch
from grpolab.training.optimization import make_optimizer, optimizer_step

PROMPTS = [
    f"Q: {a}+{b}-{c}\nA: <think>"
    for a, b, c in [(3, 5, 2), (7, 1, 4), (2, 2, 9), (8, 0, 1), (4, 6, 3), (9, 9, 5), (1, 3, 8), (5, 7, 6)]
]
GROUP = 8
MAX_NEW = 8


def reward(text: str) -> float:
    # about half the responses score 1, so few groups have zero variance (skipping saves little)
    return float(bool(text) and ord(text[0]) % 2 == 0)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def grpolab_step(model, tok, backend, optimizer, cfg, sampling, autocast, skip: bool):
    t0 = time.perf_counter()
    rollouts = backend.generate(PROMPTS, GROUP, sampling)
    t1 = time.perf_counter()
    raw = torch.tensor([reward(r.response) for r in rollouts])
    adv = normalize_group_rewards(raw, GROUP, 1e-6, True)
    batch = make_rollout_batch(rollouts, raw, adv, tok.pad_token_id)
    contributes = batch.response_mask.any(1) & ((adv != 0) | (not skip))
    accumulate_policy_gradient(model, batch, list(range(len(rollouts))), cfg, contributes, 0.0,
                               torch.device("cpu"), autocast)
    optimizer_step(model, optimizer, None, 1.0)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, int(contributes.sum())


def baseline_step(model, tok, optimizer, autocast):
    """HF generate + one padded forward/backward (the cost TRL is within ~10 % of)."""
    t0 = time.perf_counter()
    tok.padding_side = "left"
    enc = tok(PROMPTS, add_special_tokens=False, padding=True, return_tensors="pt")
    model.eval()
    with torch.inference_mode(), autocast():
        out = model.generate(**enc, do_sample=True, max_new_tokens=MAX_NEW, num_return_sequences=GROUP,
                             pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True)
    model.train()
    t1 = time.perf_counter()
    seqs = out.sequences.clone()
    completions = [tok.decode(s[enc["input_ids"].shape[1]:], skip_special_tokens=True) for s in seqs]
    raw = torch.tensor([reward(c) for c in completions])
    adv = normalize_group_rewards(raw, GROUP, 1e-6, True)
    attn = (seqs != tok.pad_token_id).long()
    prompt_len = enc["input_ids"].shape[1]
    with autocast():
        logits = model(seqs, attention_mask=attn).logits[:, prompt_len - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, seqs[:, prompt_len:].unsqueeze(-1)).squeeze(-1)
    mask = attn[:, prompt_len:].float()
    loss = (-(adv.unsqueeze(1) * lp) * mask).sum(1).div(mask.sum(1).clamp(min=1)).mean()
    loss.backward()
    optimizer_step(model, optimizer, None, 1.0)
    t2 = time.perf_counter()
    tok.padding_side = "right"
    return t1 - t0, t2 - t1


def measure(size: str, dtype: str, steps: int) -> dict:
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(size, tok, seed=0)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bfloat16" else contextlib.nullcontext
    cfg = GRPOConfig(rollout_batch_size=64, group_size=GROUP, train_batch_size=64, gradient_accumulation_steps=1,
                     sampling_max_tokens=MAX_NEW, sampling_min_tokens=0, warmup_steps=0, dtype=dtype,
                     micro_batch_token_budget=None)
    optimizer = make_optimizer(model, 1e-5)
    backend = HFRolloutBackend(model, tok, autocast_dtype=torch.bfloat16 if dtype == "bfloat16" else None,
                               generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, min_tokens=0)
    n = 64
    out = {"size": size, "dtype": dtype, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2)}
    for name, fn in [
        ("baseline", lambda: baseline_step(model, tok, optimizer, autocast) + (n,)),
        ("grpolab_noskip", lambda: grpolab_step(model, tok, backend, optimizer, cfg, sampling, autocast, False)),
        ("grpolab", lambda: grpolab_step(model, tok, backend, optimizer, cfg, sampling, autocast, True)),
    ]:
        fn()  # warm-up
        roll = train = 0.0
        trained = 0
        for _ in range(steps):
            r, t, k = fn()
            roll, train, trained = roll + r, train + t, trained + k
        out[name] = {
            "rollout_completions_per_s": round(n * steps / roll, 1),
            "train_completions_per_s": round(n * steps / train, 1),
            "step_completions_per_s": round(n * steps / (roll + train), 1),
            "s_per_step": round((roll + train) / steps, 4),
            "rows_trained_per_step": round(trained / steps, 1),
        }
    out["speedup_vs_baseline"] = round(
        out["grpolab"]["step_completions_per_s"] / out["baseline"]["step_completions_per_s"], 2
    )
    out["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for size in args.sizes.split(","):
        for dtype in args.dtypes.split(","):
            r = measure(size, dtype, args.steps)
            results.append(r)
            g, b = r["grpolab"], r["baseline"]
            print(
                f"{size:5} ({r['params_m']}M) {dtype:8}: grpolab {g['step_completions_per_s']:7.1f} completions/s "
                f"(rollout {g['rollout_completions_per_s']:.0f}/s, train {g['train_completions_per_s']:.0f}/s; "
                f"no skip {r['grpolab_noskip']['step_completions_per_s']:.1f}/s) | baseline HF generate+train "
                f"{b['step_completions_per_s']:.1f}/s | x{r['speedup_vs_baseline']}  peak RSS {r['peak_rss_mb']:.0f} MB"
            )
    best = {}
    for r in results:
        cur = best.get(r["size"])
        if cur is None or r["grpolab"]["step_completions_per_s"] > cur["grpolab"]["step_completions_per_s"]:
            best[r["size"]] = r
    summary = {
        "results": results,
        "fastest": {
            s: {"dtype": r["dtype"], "completions_per_s": r["grpolab"]["step_completions_per_s"]}
            for s, r in best.items()
        },
        "trl_reference_completions_per_s": {"tiny": 590, "small_34m_fp32": 36.6, "small_34m_bf16": 52},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
