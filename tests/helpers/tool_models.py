"""A tiny model that calls the calculator: ``train_sft`` with ``env`` on a handful of tool-using
demonstrations (the SFT-with-tools test, and the vLLM multi-turn tests that need real tool calls)."""

import json
from pathlib import Path

from grpolab.algorithms.sft import SFTConfig, train_sft

QUESTIONS = [(a, b) for a in (12, 25, 37, 48) for b in (3, 9)]
ENV = {"tools": ["calculate"], "max_turns": 2, "max_total_tokens": 96}


def tool_prompts() -> list[str]:
    """The compact template's prompts (``Q: ...\nA: <think>``), as a GRPO run on ``tool_questions`` builds them."""
    return [f"Q: {a}*{b}\nA: <think>" for a, b in QUESTIONS]


def tool_questions() -> list[dict]:
    return [{"question": f"{a}*{b}", "answer": str(a * b)} for a, b in QUESTIONS]


def tool_using_model(out_dir):
    """The embedded tiny model after a short SFT (``train_sft`` with ``env``) on calculator
    demonstrations — a call, the live observation out of the loss, the answer — so that it calls
    the tool: what the multi-turn paths need to be exercised. Returns its saved directory."""
    data = Path(out_dir) / "tools_sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": f"<calculate>{a}*{b}</calculate></think> "
                                        f"<answer>{a * b}</answer>"}) + "\n"
                            for p, (a, b) in zip(tool_prompts(), QUESTIONS)))
    cfg = SFTConfig(task=None, train_data=str(data), env=ENV, n_sft_steps=150, train_batch_size=16,
                    gradient_accumulation_steps=1, learning_rate=3e-3, warmup_steps=10, eval_examples=1,
                    sampling_max_tokens=40, run_dir=str(Path(out_dir) / "sft"), show_progress=False, device="cpu")
    return train_sft(cfg).final_dir
