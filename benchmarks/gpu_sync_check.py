"""gpu_check.sh's sampler check: a real model on the trainer's device and a vLLM sampler (colocated
``vllm``, or a ``vllm_server`` grpolab starts; NCCL weight transfer on CUDA), through ``--syncs``
weight syncs. After each sync it checks that

- the sampler's log-probs of its own samples agree with the trainer's (mean |difference| per token
  below ``--tolerance`` nats, the health check's threshold), and
- the sampler's weights changed: the policy is perturbed before every sync (a small multiple of each
  matrix's std), and the sampler's log-probs of the same greedy response move with it.

Prints one line per sync (sync and generate seconds, the gap, the shift) and the peak GPU memory the
trainer's process allocated; exits 1 when a check fails.

    python benchmarks/gpu_sync_check.py --model DIR --backend vllm --device cuda:0
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

PROMPTS = ["Q: What is 12+30?\nA: <think>", "Q: Name a prime above 50.\nA: <think>", "The capital of France is"]


def trainer_log_probs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    from grpolab.models.fused_head import response_log_probs

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + response_ids], device=device)
    labels = torch.tensor([prompt_ids[1:] + response_ids + [0]], device=device)
    with torch.no_grad():
        lp = response_log_probs(model.eval(), ids, labels, temperature=1.0)["log_probs"][0]
    start = len(prompt_ids) - 1
    return lp[start:start + len(response_ids)].float().cpu()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--backend", choices=["vllm", "vllm_server"], default="vllm")
    parser.add_argument("--device", default="cuda:0", help="the trainer's device")
    parser.add_argument("--dtype", default="bfloat16", help="the sampler's dtype")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=0.05)
    args = parser.parse_args()

    from grpolab.models import load_model_and_tokenizer
    from grpolab.rollout import SamplingParams, make_backend

    model, tok = load_model_and_tokenizer(args.model)
    model.to(args.device)
    sampler = make_backend(args.backend, model, tok, dtype=args.dtype, seed=0, gpu_memory_utilization=0.3)
    greedy, sampled = SamplingParams(temperature=0.0, max_tokens=32), SamplingParams(temperature=1.0, max_tokens=32)
    failures, previous = [], None
    try:
        for sync in range(args.syncs):
            if sync:
                with torch.no_grad():  # the policy moves: every matrix by 2 % of its std
                    for p in model.parameters():
                        if p.dim() == 2:
                            p.add_(torch.randn_like(p) * p.std() * 0.02)
            sampler.sync_weights(model)
            t0 = time.perf_counter()
            rollouts = sampler.generate(PROMPTS, 4, sampled)
            generate_s = time.perf_counter() - t0
            gaps = [(torch.tensor(r.logprobs) - trainer_log_probs(model, r.prompt_ids, r.response_ids)).abs().mean()
                    for r in rollouts if r.response_ids]
            gap = float(torch.stack(gaps).mean())
            first = sampler.generate(PROMPTS[:1], 1, greedy)[0]
            now = torch.tensor(first.logprobs)
            shift = None
            if previous is not None and previous[0] == first.response_ids:
                shift = float((now - previous[1]).abs().mean())
            elif previous is not None:
                shift = float("inf")  # another greedy response: the weights changed
            previous = (first.response_ids, now)
            print(f"gpu_sync_check {args.backend} sync {sync}: sync {sampler.last_sync_s:.2f} s, generate "
                  f"{generate_s:.2f} s ({sum(len(r.response_ids) for r in rollouts)} tokens), sampler/trainer gap "
                  f"{gap:.4f} nats" + ("" if shift is None else f", greedy log-prob shift {shift:.4f}"), flush=True)
            if not gap < args.tolerance:
                failures.append(f"sync {sync}: sampler/trainer gap {gap:.4f} >= {args.tolerance}")
            if shift is not None and not shift > 0:
                failures.append(f"sync {sync}: the sampler's log-probs did not move with the weights")
    finally:
        sampler.close()
    if torch.cuda.is_available():
        print(f"gpu_sync_check {args.backend}: trainer peak allocated "
              f"{torch.cuda.max_memory_allocated(args.device) / 2**30:.2f} GiB")
    for failure in failures:
        print(f"gpu_sync_check {args.backend}: FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
