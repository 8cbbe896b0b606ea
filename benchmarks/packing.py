"""Padding-free packing against padded micro-batches in GRPO's update (prints figures; not a test).

One optimizer batch of a synthetic rollout batch (prompts x group responses; random token ids,
prompt lengths differing by prompt, response lengths drawn uniformly from 1..max_new so a
micro-batch's rows differ a lot, as GRPO's do) goes through ``accumulate_policy_gradient`` three
ways: padded rows (``share_prompt_prefix: false, packing: false``), packed rows (``packing: true``)
and the shared-prompt forward (``share_prompt_prefix: true``, the default). For each it prints the
tokens the forwards compute (padding included) and the median update time; the packed/padded and
packed/shared time ratios come from the same process. Models: the embedded tiny model and
SmolLM2-135M-Instruct (``~/.cache/grpolab``, skipped when absent), float32 and bf16 autocast.

Usage: python benchmarks/packing.py [--repeats N] [--models tiny,smollm2] [--dtypes float32,bfloat16]
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.algorithms.grpo_update import accumulate_policy_gradient, forward_tokens, pass_tokens
from grpolab.core import normalize_group_rewards
from grpolab.models import build_char_tokenizer, build_tiny_model
from grpolab.rollout.base import Rollout
from grpolab.training.batching import RolloutBatch, make_rollout_batch, plan_microbatches
from grpolab.training.packing import row_lengths

SMOLLM2 = Path.home() / ".cache" / "grpolab" / "SmolLM2-135M-Instruct"
# name -> (prompts, group, prompt tokens range, most response tokens, gradient_accumulation_steps)
SHAPES = {"tiny": (8, 8, (20, 60), 128, 4), "smollm2": (2, 8, (40, 120), 160, 2)}


def synthetic_batch(vocab: int, pad_id: int, prompts: int, group: int, prompt_range, max_new: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    rollouts = []
    for p in range(prompts):
        n_p = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=g))
        prompt = torch.randint(5, vocab, (n_p,), generator=g).tolist()
        for _ in range(group):
            n_r = int(torch.randint(1, max_new + 1, (1,), generator=g))
            response = torch.randint(5, vocab, (n_r,), generator=g).tolist()
            rollouts.append(Rollout(prompt="", prompt_ids=prompt, response_ids=response, response="",
                                    logprobs=[0.0] * n_r,
                                    finish_reason="length", prompt_index=p))
    raw = torch.randint(0, 2, (len(rollouts),), generator=g).float()
    raw[::group] = 1 - raw[1::group]  # no group without variance
    adv = normalize_group_rewards(raw, group, 1e-6, True)
    return make_rollout_batch(rollouts, raw, adv, pad_id)


def time_update(model, batch, cfg, autocast, repeats: int) -> float:
    rows = list(range(len(batch.sequences)))
    contributes = batch.response_mask.any(1)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        accumulate_policy_gradient(model, batch, rows, cfg, contributes, 0.0, torch.device("cpu"), autocast)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure(name: str, dtype: str, repeats: int) -> dict:
    torch.manual_seed(0)
    if name == "tiny":
        tok = build_char_tokenizer()
        model = build_tiny_model("tiny", tok, seed=0)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(SMOLLM2)
        model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    model.train()
    prompts, group, prompt_range, max_new, accumulation = SHAPES[name]
    batch = synthetic_batch(model.config.vocab_size, tok.pad_token_id or 0, prompts, group, prompt_range, max_new)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bfloat16" else contextlib.nullcontext
    n = len(batch.sequences)
    base = dict(rollout_batch_size=n, group_size=group, train_batch_size=n, gradient_accumulation_steps=accumulation,
                sampling_max_tokens=max_new, warmup_steps=0, dtype=dtype)
    lengths = row_lengths(batch.response_mask).tolist()
    plans = plan_microbatches(lengths, accumulation)
    out = {"model": name, "dtype": dtype, "rows": n, "micro_batches": len(plans),
           "tokens": {"padded": pass_tokens(batch.sequences, plans, False),
                      "packed": sum(forward_tokens(batch.sequences, p, False) for p in plans),
                      "shared": pass_tokens(batch.sequences, plans, True)}}
    out["padded_tokens_removed"] = round(1 - out["tokens"]["packed"] / out["tokens"]["padded"], 3)
    times = {}
    for mode, extra in [("padded", dict(share_prompt_prefix=False, packing="false")),
                        ("packed", dict(share_prompt_prefix=False, packing="true")),
                        ("shared", dict(share_prompt_prefix=True))]:
        times[mode] = time_update(model, batch, GRPOConfig(**base, **extra), autocast, repeats)
    out["update_s"] = {k: round(v, 4) for k, v in times.items()}
    out["packed_over_padded"] = round(times["packed"] / times["padded"], 3)
    out["packed_over_shared"] = round(times["packed"] / times["shared"], 3)
    print(f"{name} {dtype}: {n} rows in {len(plans)} micro-batches; tokens padded {out['tokens']['padded']}, "
          f"packed {out['tokens']['packed']} ({out['padded_tokens_removed']:.0%} removed), shared-prompt "
          f"{out['tokens']['shared']}; update s padded {times['padded']:.3f} packed {times['packed']:.3f} "
          f"shared {times['shared']:.3f}; packed/padded {out['packed_over_padded']:.3f}, "
          f"packed/shared {out['packed_over_shared']:.3f}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models.split(","):
        if name == "smollm2" and not SMOLLM2.exists():
            print(f"smollm2: skipped ({SMOLLM2} absent: make real-model)")
            continue
        for dtype in args.dtypes.split(","):
            results.append(measure(name, dtype, args.repeats))
    print(json.dumps({"threads": args.threads, "torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
