"""Grading speed: GSM8K-style R1-Zero responses graded per second, in-process (one core) and with
a process pool, and the per-response cost of the supervised reward worker (a user reward's default
path) against calling the same reward in-process, on batches of 128. Uses
../shared/data/gsm8k/test.jsonl when present, else generated responses. Prints figures; the last
line is one JSON object. ``--overhead-only`` measures only the supervision overhead (seconds)."""

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


def supervision_overhead(data, batch: int = 128, repeats: int = 20) -> dict:
    """Microseconds per response of three ways to run one reward on a batch: a direct call in
    this thread (no timeout: what built-ins get), a thread with a timeout (the old default; cannot
    stop a hang or survive a crash) and the supervised worker process (the default for user
    rewards). For the cheap ``arithmetic`` reward the difference is pure overhead."""
    out = {}
    arithmetic = [(f"r</think> <answer>{i}</answer>", str(i if i % 3 else i + 1)) for i in range(batch)]
    modes = {"direct": dict(timeout_s=0, isolation="inprocess"), "thread": dict(timeout_s=10.0, isolation="inprocess"),
             "supervised": dict(timeout_s=10.0, isolation="process")}
    for name, items in (("arithmetic", arithmetic), ("r1_zero", data[:batch])):
        responses_, gts = [d[0] for d in items], [d[1] for d in items]
        us = {}
        for mode, kwargs in modes.items():
            with RewardScorer(name, **kwargs) as scorer:
                first = scorer.score(responses_, gts)  # starts the worker; warms caches
                start = time.perf_counter()
                for _ in range(repeats):
                    assert scorer.score(responses_, gts) == first
                us[mode] = round((time.perf_counter() - start) / (repeats * batch) * 1e6, 1)
        us["supervised_overhead"] = round(us["supervised"] - us["direct"], 1)
        out[name] = us
        print(f"{name:>10}, batch of {batch}, us/response: direct {us['direct']:6.1f}, "
              f"thread+timeout {us['thread']:6.1f}, "
              f"supervised worker {us['supervised']:6.1f} (overhead {us['supervised_overhead']:+.1f} us/response, "
              f"{us['supervised_overhead'] * batch / 1000:.1f} ms per batch)")
    return out


def main() -> None:
    data = responses()
    if "--overhead-only" in sys.argv:
        print(json.dumps({"supervision_overhead": supervision_overhead(data)}))
        return
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
    print(f"RewardScorer (built-in: in-process, no thread): {safe:,.0f} responses/s")
    scorer.close()

    pool = RewardScorer(r1_zero_reward_fn, timeout_s=10.0, num_workers=2)
    pool.score([d[0] for d in data], [d[1] for d in data])  # start both workers and their math-verify children
    start = time.perf_counter()
    pool.score([d[0] for d in data], [d[1] for d in data])
    pooled = len(data) / (time.perf_counter() - start)
    print(f"RewardScorer, 2 supervised workers: {pooled:,.0f} responses/s")
    pool.close()
    overhead = supervision_overhead(data)
    print(json.dumps({"responses": len(data), "inprocess_per_s": round(inproc), "scorer_per_s": round(safe),
                      "pool2_per_s": round(pooled), "target_per_s": 500, "gsm8k": GSM8K.exists(),
                      "supervision_overhead": overhead}))
    sys.exit(0)


if __name__ == "__main__":
    main()
