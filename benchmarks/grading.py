"""Grading speed: GSM8K-style R1-Zero responses graded per second, in-process (one core) and with
a process pool. Uses ../shared/data/gsm8k/test.jsonl when present, else generated responses.
Prints figures; the last line is one JSON object."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from grpolab.rewards import RewardScorer, r1_zero_reward_fn

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def responses(n: int = 2000):
    rng = random.Random(0)
    if GSM8K.exists():
        from grpolab.data import load_gsm8k

        ex = load_gsm8k(GSM8K)
        pairs = [(e.solution, e.answer) for e in ex]
    else:
        pairs = []
        for _ in range(n):
            a = rng.randint(1, 5000)
            pairs.append((f"She has {a} apples.</think> <answer>{a:,}</answer>", str(a)))
    out = []
    for i in range(n):
        sol, gold = pairs[i % len(pairs)]
        # a realistic mix: right answers, wrong answers, formatting failures, LaTeX answers
        kind = i % 4
        if kind == 1:
            sol = sol.replace("<answer>", "<answer>1") if "<answer>" in sol else sol
        elif kind == 2:
            sol = sol.replace("</think> <answer>", "</think><answer>")
        elif kind == 3:
            sol = sol.split("<answer>")[0] + f"<answer>\\boxed{{{gold}}} \\text{{ dollars}}</answer>"
        out.append((sol, gold))
    return out


def main() -> None:
    data = responses()
    from grpolab.rewards import is_equivalent

    is_equivalent("x+1", "1+x")  # start the math-verify worker outside the timing
    slow = sum(1 for sol, gold in data if "\\" in sol.split("<answer>")[-1])
    start = time.perf_counter()
    for sol, gold in data:
        r1_zero_reward_fn(sol, gold)
    inproc = len(data) / (time.perf_counter() - start)
    print(f"in-process, one core: {inproc:,.0f} responses/s over {len(data)} responses ({slow} with LaTeX answers)")

    scorer = RewardScorer(r1_zero_reward_fn, timeout_s=10.0)
    start = time.perf_counter()
    scorer.score([d[0] for d in data], [d[1] for d in data])
    safe = len(data) / (time.perf_counter() - start)
    print(f"RewardScorer (per-call timeout): {safe:,.0f} responses/s")
    scorer.close()

    pool = RewardScorer(r1_zero_reward_fn, timeout_s=10.0, num_workers=2)
    pool.score([d[0] for d in data[:256]], [d[1] for d in data[:256]])  # start both workers
    start = time.perf_counter()
    pool.score([d[0] for d in data], [d[1] for d in data])
    pooled = len(data) / (time.perf_counter() - start)
    print(f"RewardScorer, process pool of 2: {pooled:,.0f} responses/s")
    pool.close()
    print(json.dumps({"responses": len(data), "inprocess_per_s": round(inproc), "scorer_per_s": round(safe),
                      "pool2_per_s": round(pooled), "target_per_s": 500, "gsm8k": GSM8K.exists()}))
    sys.exit(0)


if __name__ == "__main__":
    main()
