"""SFT on prompts that already hold their template (issue 55): CS336's sft.jsonl, whose prompts are
the whole r1_zero text, is trained on as it is -- never wrapped in r1_zero a second time -- and
validated with r1_zero, whether prompt_template is r1_zero or unset (even for a tokenizer with a chat
template, whose default would be chat_r1); one line says what was detected."""

import json

import pytest

from grpolab.algorithms.sft import SFTConfig, sft_pairs, train_sft
from grpolab.data.prompts import R1_ZERO_PROMPT
from tests.helpers.chat_models import chat_model_dir

QUESTIONS = ["What is 2 + 3?", "What is 4 + 1?", "What is 1 + 1?", "What is 3 + 3?"]


def _cs336_files(tmp_path):
    """An sft.jsonl as CS336's (r1_zero prompt, response from inside <think>), and validation questions."""
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": R1_ZERO_PROMPT.replace("{question}", q),
                                       "response": f" {q[8:13]} </think> <answer>{eval(q[8:13])}</answer>",
                                       "ground_truth": str(eval(q[8:13]))}) + "\n" for q in QUESTIONS))
    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join(json.dumps({"question": q, "answer": str(eval(q[8:13]))}) + "\n"
                                  for q in QUESTIONS))
    return sft, validation


@pytest.mark.parametrize("prompt_template", ["r1_zero", None])
def test_cs336_sft_prompts_are_used_as_they_are_and_validated_with_r1_zero(tmp_path, capsys, prompt_template):
    sft, validation = _cs336_files(tmp_path)
    model = chat_model_dir(tmp_path / "chat")  # a chat template: unset, validation would default to chat_r1
    cfg = SFTConfig(model=str(model), train_data=str(sft), eval_data=str(validation), prompt_template=prompt_template,
                    n_sft_steps=1, train_batch_size=2, gradient_accumulation_steps=1, eval_examples=2, eval_every=1,
                    sampling_max_tokens=4, warmup_steps=0, run_dir=str(tmp_path / "run"), show_progress=False,
                    device="cpu")
    pairs, inputs = sft_pairs(cfg)
    assert [p.prompt for p in pairs] == [R1_ZERO_PROMPT.replace("{question}", q) for q in QUESTIONS]
    assert inputs.template.name == "r1_zero"
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("grpolab sft:"))
    assert line.startswith(f"grpolab sft: 4 of 4 prompts of {sft} already hold the r1_zero template")
    result = train_sft(cfg)
    samples = [json.loads(x) for x in (result.run_dir / "samples" / "eval_step_0.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in samples] == [R1_ZERO_PROMPT.replace("{question}", q) for q in QUESTIONS[:2]]
