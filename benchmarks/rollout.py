"""Rollout speed: the Hugging Face lean decoder vs a colocated vLLM engine, side by side in one run
(prints figures; not a test). Needs vLLM: ``make bench-rollout`` runs it in ``.venv-vllm``.

For each embedded model size (``tiny`` 0.9M, ``small`` 9.5M parameters, random init, float32) and
each response length (8, 32, 256 new tokens; ``min_tokens == max_tokens`` so every completion has
exactly that many tokens and the two backends do the same work), both backends sample the same
256 completions (32 prompts x 8), after one warm-up call; the best of ``--repeats`` timings is
kept. Then one GRPO step per backend on the same shapes as ``benchmarks/grpo_step.py`` (64
completions of up to 32 tokens, the micro-batched update, and for vLLM the in-place weight sync).

Usage: python benchmarks/rollout.py [--sizes tiny,small] [--lengths 8,32,256] [--repeats 2]
       [--device cuda --dtype bfloat16 --sizes qwen2-1.5b]   (a GPU: benchmarks/gpu_check.sh)
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time

import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.algorithms.grpo_update import accumulate_policy_gradient
from grpolab.core import normalize_group_rewards
from grpolab.models import build_char_tokenizer, build_tiny_model
from grpolab.rollout import SamplingParams, make_backend
from grpolab.training.batching import make_rollout_batch
from grpolab.training.optimization import make_optimizer, optimizer_step

PROMPTS = [f"Q: {a}+{b}-{c}\nA: <think>" for a in range(1, 9) for b, c in [(3, 5), (7, 1), (2, 2), (8, 0)]]  # 32
GROUP = 8


def timed_generate(backend, prompts, n, sampling, repeats):
    backend.generate(prompts[:4], n, sampling)  # warm-up: caches, kernels, first allocations
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = backend.generate(prompts, n, sampling)
        best = min(best, time.perf_counter() - t0)
        tokens = sum(len(r.response_ids) for r in out)
    return {"completions_per_s": round(len(prompts) * n / best, 1), "tokens_per_s": round(tokens / best, 1),
            "seconds": round(best, 3)}


def grpo_step(model, tok, backend, optimizer, cfg, sampling, device="cpu"):
    """One on-policy GRPO step (rollout, update, weight sync) -> seconds per phase."""
    t0 = time.perf_counter()
    rollouts = backend.generate(PROMPTS[:8], GROUP, sampling)
    t1 = time.perf_counter()
    raw = torch.tensor([float(bool(r.response) and ord(r.response[0]) % 2 == 0) for r in rollouts])
    batch = make_rollout_batch(rollouts, raw, normalize_group_rewards(raw, GROUP, 1e-6, True), tok.pad_token_id)
    contributes = batch.response_mask.any(1)
    accumulate_policy_gradient(model, batch, list(range(len(rollouts))), cfg, contributes, 0.0, torch.device(device),
                               contextlib.nullcontext)
    optimizer_step(model, optimizer, None, 1.0)
    t2 = time.perf_counter()
    backend.sync_weights(model)
    t3 = time.perf_counter()
    return {"rollout_s": t1 - t0, "update_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0}


# A Qwen2-1.5B-shaped model (Qwen2.5-Math-1.5B's config) with random weights: nothing to download.
QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True)


def build_model(size, tok, device, dtype):
    if size != "qwen2-1.5b":
        return build_tiny_model(size, tok, seed=0).to(device=device, dtype=dtype)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**QWEN2_1_5B, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def bench_size(size, lengths, repeats, backends, device="cpu", dtype="float32"):
    tok = build_char_tokenizer()
    model = build_model(size, tok, device, getattr(torch, dtype))
    out = {}
    engines = {name: make_backend(name, model, tok, dtype=dtype, seed=0, gpu_memory_utilization=0.3)
               for name in backends}
    for length in lengths:
        sampling = SamplingParams(temperature=1.0, max_tokens=length, min_tokens=length, seed=0)
        for name, backend in engines.items():
            out[f"{name}/{length}"] = timed_generate(backend, PROMPTS, GROUP, sampling, repeats)
            print(f"{size:>5} {length:>4} tokens  {name:>4}: {out[f'{name}/{length}']}", flush=True)
    cfg = GRPOConfig(rollout_batch_size=64, group_size=GROUP, train_batch_size=64, gradient_accumulation_steps=2,
                     sampling_max_tokens=32, device=device)
    sampling = SamplingParams(temperature=1.0, max_tokens=32, min_tokens=1, stop=["</answer>"], seed=0)
    for name, backend in engines.items():
        optimizer = make_optimizer(model, 1e-5, (0.9, 0.95), 0.0)
        grpo_step(model, tok, backend, optimizer, cfg, sampling, device)  # warm-up
        steps = [grpo_step(model, tok, backend, optimizer, cfg, sampling, device) for _ in range(repeats)]
        best = min(steps, key=lambda s: s["step_s"])
        out[f"{name}/grpo_step"] = {k: round(v, 3) for k, v in best.items()}
        print(f"{size:>5} GRPO step  {name:>4}: {out[f'{name}/grpo_step']}", flush=True)
    for backend in engines.values():
        backend.close()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--lengths", default="8,32,256")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    figures = {"machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                          f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}",
               "cpu_count": os.cpu_count()}
    print(figures["machine"])
    for size in args.sizes.split(","):
        figures[size] = bench_size(size, lengths, args.repeats, args.backends.split(","), args.device, args.dtype)
    for size in args.sizes.split(","):
        print(f"\n{size}: vLLM / HF speed")
        for length in lengths:
            hf, vl = figures[size].get(f"hf/{length}"), figures[size].get(f"vllm/{length}")
            if hf and vl:
                print(f"  {length:>4} tokens: {vl['completions_per_s'] / hf['completions_per_s']:.2f}x")
        hf, vl = figures[size].get("hf/grpo_step"), figures[size].get("vllm/grpo_step")
        if hf and vl:
            print(f"  GRPO step: HF {hf['step_s']:.3f}s, vLLM {vl['step_s']:.3f}s (sync {vl['sync_s']:.3f}s)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
