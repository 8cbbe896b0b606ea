"""On-policy distillation on the real model: SmolLM2-135M-Instruct as the teacher, a student moved
away from it by a few SFT steps, and a few distillation steps bring the student's reverse KL to the
teacher down on held-out prompts (measured on the student's own samples before and after)."""

import json


def test_a_few_distillation_steps_lower_the_held_out_reverse_kl(smollm2_dir, tmp_path):
    from grpolab.algorithms.distill import DistillConfig, train_distill
    from grpolab.algorithms.sft import SFTConfig, train_sft

    # the student: SmolLM2 after 6 SFT steps towards terse wrong sums (far from the teacher's replies)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "response": str(a + b + 7)}) + "\n"
                            for a in range(10, 18) for b in range(20, 24)))
    student = train_sft(SFTConfig(model=str(smollm2_dir), task=None, train_data=str(data), prompt_template="chat",
                                  run_dir=str(tmp_path / "sft"), n_sft_steps=6, train_batch_size=8,
                                  gradient_accumulation_steps=1, learning_rate=1e-4, warmup_steps=0,
                                  lr_schedule="constant", show_progress=False, device="cpu")).final_dir
    cfg = DistillConfig(model=str(student), teacher=str(smollm2_dir), task="arithmetic",
                        task_options={"digits": 2, "num_ops": 1, "ops": "+", "phrasing": "words"},
                        prompt_template="chat", reward="question_only", n_distill_steps=4, rollout_batch_size=16,
                        group_size=4, train_batch_size=16, gradient_accumulation_steps=2, learning_rate=2e-5,
                        sampling_temperature=0.7, eval_temperature=0.7, sampling_max_tokens=16, stop=["\n"],
                        eval_examples=16, eval_every=0, log_generations_samples=0, run_dir=str(tmp_path / "distill"),
                        show_progress=False, device="cpu")
    result = train_distill(cfg)
    before, after = result.before["reverse_kl"], result.after["reverse_kl"]
    assert before > 0.05, before  # the student was moved away from its teacher
    assert after < 0.8 * before, (before, after)
