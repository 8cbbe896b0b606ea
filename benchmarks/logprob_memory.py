"""Peak memory of scoring tokens with a real vocabulary: the old unchunked log-probs/entropy (whole
(rows, L, V) float32 logits, then a log-softmax with its temporaries — reimplemented here as the
baseline) against grpolab's chunked head (``models.fused_head.response_log_probs``), on SmolLM2-135M-Instruct
(vocab 49,152, GQA 9/3 heads, tied embeddings) when ``~/.cache/grpolab/SmolLM2-135M-Instruct`` exists
(``scripts/real_model.py`` makes it), else on a random Llama of the same shapes (said in the output).
Prints figures; not a test.

Two workloads, at ``--length`` tokens per row (default 1024):

- eval entropy: per-token entropy of ``--eval-rows`` rollouts (64, ``grpolab eval``'s batch), no
  gradients. Before: one forward of all rows (``token_entropies``' old batch of 64) and the old
  formula. After: ``eval.token_entropies`` as it is now (rows packed under a token budget, logits
  chunked). The baseline's logits alone are rows x L x V x 4 bytes (12.9 GB for 64 x 1024), three
  copies at its peak: configurations predicted above ``--max-baseline-gb`` are not run (their
  prediction is printed), the baseline is measured at fewer rows instead to show its growth.
- train step: forward + backward of one micro-batch of ``--micro-batch`` rows with a GRPO-shaped
  loss (advantage x log-prob + entropy bonus), as ``algorithms.grpo_update`` runs it.

Every figure is measured in a fresh subprocess: the model is loaded, the process's peak RSS is reset
(``/proc/self/clear_refs``), the workload runs once, and the peak RSS (``VmHWM``) minus the RSS after
loading is reported (extra memory, MB). ``--threads`` torch threads (default 1).

Usage: python benchmarks/logprob_memory.py [--length 1024] [--eval-rows 64] [--micro-batch 2]
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REAL = Path.home() / ".cache" / "grpolab" / "SmolLM2-135M-Instruct"
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024  # MB
    raise KeyError(key)


def load_model():
    if REAL.is_dir():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(REAL, dtype=torch.float32).eval()
        name = f"SmolLM2-135M-Instruct ({REAL})"
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).eval()
        name = "random Llama with SmolLM2-135M's shapes (no real model found)"
    with torch.no_grad():  # weights in resident memory now (not pages of a mapped file touched later)
        for p in model.parameters():
            p.data = p.data.clone()
    return model, name


# ---------------------------------------------------------------- the old computation (baseline)


def old_log_probs_from_logits(logits, labels, return_token_entropy, temperature=1.0):
    """grpolab.core.log_probs_from_logits before chunking: the whole (B, L, V) tensor at once."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    log_probs = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if return_token_entropy:
        probs = torch.exp(logits - lse.unsqueeze(-1))
        entropy = lse - (probs * logits).sum(dim=-1)
    return log_probs, entropy


def old_get_response_log_probs(model, input_ids, labels, return_token_entropy=False, temperature=1.0):
    logits = model(input_ids).logits
    lp, ent = old_log_probs_from_logits(logits, labels, return_token_entropy, temperature)
    return {"log_probs": lp, "token_entropy": ent}


# ---------------------------------------------------------------- workloads (run in the child)


def rollouts(rows: int, length: int, vocab: int):
    from grpolab.rollout import Rollout

    g = torch.Generator().manual_seed(0)
    prompt = length // 8
    response = length - prompt
    return [Rollout("p", "r", torch.randint(3, vocab, (prompt,), generator=g).tolist(),
                    torch.randint(3, vocab, (response,), generator=g).tolist(), [0.0] * response, "length")
            for _ in range(rows)]


def eval_entropy(model, rows: int, length: int, impl: str) -> float:
    from grpolab.core import build_sequences
    from grpolab.eval import token_entropies

    data = rollouts(rows, length, model.config.vocab_size)
    tok = type("Tok", (), {"pad_token_id": 2, "eos_token_id": 2})()
    if impl == "after":
        return sum(token_entropies(model, data, tok, temperature=1.0)) / rows
    # before: token_entropies' old loop, one forward of all rows (its batch of 64), the old formula
    seq = build_sequences([r.prompt_ids for r in data], [r.response_ids for r in data], 2)
    with torch.inference_mode():
        ent = old_get_response_log_probs(model, seq["input_ids"], seq["labels"], True)["token_entropy"]
    return float((ent * seq["response_mask"]).sum() / seq["response_mask"].sum())


def train_step(model, rows: int, length: int, impl: str) -> float:
    from grpolab.core import build_sequences
    from grpolab.models.fused_head import response_log_probs

    data = rollouts(rows, length, model.config.vocab_size)
    seq = build_sequences([r.prompt_ids for r in data], [r.response_ids for r in data], 2)
    model.train()
    fn = response_log_probs if impl == "after" else old_get_response_log_probs
    out = fn(model, seq["input_ids"], seq["labels"], True)
    mask, adv = seq["response_mask"], torch.linspace(-1, 1, rows)[:, None]
    loss = -((adv * out["log_probs"] + 0.01 * out["token_entropy"]) * mask).sum() / mask.sum()
    loss.backward()
    return float(loss)


def child(args) -> None:
    torch.set_num_threads(args.threads)
    model, name = load_model()
    for p in model.parameters():
        p.grad = None
    loaded = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from the current RSS
        f.write("5")
    start = time.perf_counter()
    fn = eval_entropy if args.workload == "eval" else train_step
    value = fn(model, args.rows, args.length, args.impl)
    seconds = time.perf_counter() - start
    print(json.dumps({"model": name, "loaded_mb": loaded, "peak_mb": _status("VmHWM"),
                      "extra_mb": _status("VmHWM") - loaded, "seconds": seconds, "value": value}))


# ---------------------------------------------------------------- the table (parent)


def measure(args, workload: str, impl: str, rows: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--workload", workload, "--impl", impl, "--rows", str(rows),
           "--length", str(args.length), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--baseline-eval-rows", default="2,4,8", help="fewer rows for the baseline's growth")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-baseline-gb", type=float, default=8.0,
                    help="do not run a baseline whose predicted peak (3 x rows x L x V x 4 bytes) is above this")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=["eval", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=["before", "after"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    vocab = SMOLLM2["vocab_size"]
    predicted_gb = lambda rows: 3 * rows * (args.length - 1) * vocab * 4 / 1e9  # noqa: E731
    plan = [("eval", "after", args.eval_rows)]
    for rows in sorted({*map(int, args.baseline_eval_rows.split(",")), args.eval_rows}):
        plan.append(("eval", "before", rows))
        if rows != args.eval_rows:
            plan.append(("eval", "after", rows))
    plan += [("train", "before", args.micro_batch), ("train", "after", args.micro_batch)]
    results = []
    for workload, impl, rows in plan:
        if impl == "before" and predicted_gb(rows) > args.max_baseline_gb:
            res = {"skipped": f"predicted >= {predicted_gb(rows):.1f} GB of logits and temporaries"}
        else:
            res = measure(args, workload, impl, rows)
        results.append({"workload": workload, "impl": impl, "rows": rows, **res})
        print(f"  {workload:5s} {impl:6s} rows={rows:3d}: {json.dumps(res)}", file=sys.stderr, flush=True)

    model = next((r["model"] for r in results if "model" in r), "?")
    print(f"\nmodel: {model}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{args.threads} thread(s); length {args.length} tokens per row; float32")
    print("extra peak RSS over the loaded model (MB), each in a fresh process; time in seconds\n")
    print("| workload | rows x tokens | before (unchunked) | after (chunked) |")
    print("|---|---|---|---|")

    def cell(r):
        if r is None:
            return "-"
        if "skipped" in r:
            return f"not run: {r['skipped']}"
        if "error" in r:
            return f"failed: {r['error'][:60]}"
        return f"{r['extra_mb']:,.0f} MB ({r['seconds']:.1f} s)"

    keys = []
    for r in results:
        key = (r["workload"], r["rows"])
        if key not in keys:
            keys.append(key)
    for workload, rows in keys:
        before = next((r for r in results if (r["workload"], r["rows"], r["impl"]) == (workload, rows, "before")), None)
        after = next((r for r in results if (r["workload"], r["rows"], r["impl"]) == (workload, rows, "after")), None)
        label = "eval entropy" if workload == "eval" else "train fwd+bwd"
        print(f"| {label} | {rows} x {args.length} | {cell(before)} | {cell(after)} |")
    print(json.dumps({"model": model, "length": args.length, "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
