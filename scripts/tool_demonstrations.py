"""Tool demonstrations for SFT with native function calling (``env: {tool_format: chat_template}``),
written by the task's own generator: for each training question of the embedded ``arithmetic`` task
a ``{messages}`` conversation in which the assistant calls ``calculate`` with the question's
expression (OpenAI ``tool_calls``), reads its result and answers with it. The ``tool`` message's
content is the calculator's, but SFT replaces it with the live tool's result anyway
(``envs.replay_chat_demonstrations``).

    python scripts/tool_demonstrations.py --n 320 --out configs/real/smollm2_135m_tool_demos.jsonl

The questions are the task's train split (``--digits``, ``--ops``; ``phrasing: words``, as the
recipe's configs ask them), so ``grpolab eval`` on the task (its test split) is held out. Each
line carries ``ground_truth`` (the answer) so ``filter_correct`` can check it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grpolab.data.tasks import get_task
from grpolab.envs import Calculator


def demonstrations(n: int, digits: int, ops: str, seed: int, system_prompt: str | None) -> list[dict]:
    task = get_task("arithmetic", seed=seed, options={"digits": digits, "num_ops": 1, "ops": ops,
                                                      "phrasing": "words", "wrong_fraction": 0.0})
    calculator = Calculator()
    out = []
    for ex in task.examples("train", n):
        expression = ex.question.removeprefix("What is ").removesuffix("?")
        result = calculator.run([expression])[0]
        if result.error is not None or result.text != ex.answer:
            raise SystemExit(f"tool_demonstrations: calculate({expression!r}) gave {result.text or result.error}, "
                             f"the task's answer is {ex.answer}")
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculate", "arguments": json.dumps({"expression": expression})}}
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": ex.question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "name": "calculate", "content": result.text},
            {"role": "assistant", "content": ex.answer}]
        out.append({"messages": messages, "ground_truth": ex.answer})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=320, help="demonstrations (train-split questions)")
    parser.add_argument("--digits", type=int, default=3, help="digits of each number (task_options.digits)")
    parser.add_argument("--ops", default="*", help="operations (task_options.ops)")
    parser.add_argument("--seed", type=int, default=0, help="the task's seed (the run's seed: the same splits)")
    parser.add_argument("--system-prompt", default=None, help="a system message first (default: none; the run's "
                        "system_prompt is put first by SFT, as in its rollouts)")
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    args = parser.parse_args(argv)
    rows = demonstrations(args.n, args.digits, args.ops, args.seed, args.system_prompt)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} demonstrations -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
