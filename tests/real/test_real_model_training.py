"""The front door with a real chat model (SmolLM2-135M-Instruct): chat-formatted evaluation that
ends at the end-of-turn token, SFT that teaches a model to stop, GRPO whose sampler and trainer
agree, and a LoRA run's final/ that grpolab itself loads."""

import json
import subprocess
import sys

import pytest
import torch

QUESTIONS = ["What is the capital of France?", "Name one primary color.", "How many days are in a week?",
             "Which animal says moo?", "What is the largest planet in the solar system?",
             "Name a fruit that is yellow.", "What is the capital of Japan?", "What is 2 + 2?",
             "Answer in one word: what is the color of grass?", "What is the capital of Germany?"]


def _grpolab(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpolab", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=900)


def _questions(path):
    path.write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in QUESTIONS))
    return path


def _generations(out):
    return [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]


def test_eval_renders_the_chat_template_and_greedy_answers_end_at_eos(smollm2_dir, tmp_path):
    data = _questions(tmp_path / "q.jsonl")
    common = ["--model", smollm2_dir, "--data", data, "--n", len(QUESTIONS), "--k", 1, "--temperature", 0,
              "--max-tokens", 96, "--stop", "", "--reward", "question_only", "--no-entropy"]
    # the chat template is asked for: a tokenizer's own template never chooses the prompts (CS336's r1_zero is the
    # default), and the choice is said in one line
    done = _grpolab("eval", *common, "--prompt-template", "chat", "--out", tmp_path / "chat")
    assert done.returncode == 0, done.stderr
    assert "prompt template chat" in done.stderr
    assert "up to 960 sampled tokens" in done.stderr  # the plan before sampling
    gens = _generations(tmp_path / "chat")
    assert all(g["prompt"].startswith("<|im_start|>") and g["prompt"].endswith("<|im_start|>assistant\n") for g in gens)
    ended = sum(g["finish_reason"] == "eos" for g in gens)
    assert ended >= 0.8 * len(gens), [g["response"] for g in gens]
    assert any("Paris" in g["response"] for g in gens)
    # the same questions fed raw (no chat template): the model does not know its turn ended
    raw = _grpolab("eval", *common, "--prompt-template", "question_only", "--out", tmp_path / "raw")
    assert raw.returncode == 0, raw.stderr
    assert sum(g["finish_reason"] == "eos" for g in _generations(tmp_path / "raw")) < ended


def _stop_pairs():
    """Demonstrations in a raw (non-chat) format the model has never seen, without an eos."""
    return [{"prompt": f"Q: {a} plus {b}\nA:", "response": f" The answer is {a + b}."}
            for a in range(2, 9) for b in range(3, 7)]


@pytest.mark.parametrize("append_eos", [True, False])
def test_sft_on_pairs_without_eos_teaches_the_model_to_stop(smollm2_dir, tmp_path, append_eos):
    from grpolab.algorithms.sft import SFTConfig, train_sft
    from grpolab.models import load_model_and_tokenizer
    from grpolab.rollout import SamplingParams, make_backend

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in _stop_pairs()))
    cfg = SFTConfig(model=str(smollm2_dir), task=None, train_data=str(data), run_dir=str(tmp_path / "run"),
                    n_sft_steps=12, train_batch_size=8, gradient_accumulation_steps=2, learning_rate=1e-4,
                    warmup_steps=0, lr_schedule="constant", append_eos=append_eos, show_progress=False, device="cpu")
    result = train_sft(cfg)
    model, tok = load_model_and_tokenizer(str(result.final_dir))
    prompts = [f"Q: {a} plus {b}\nA:" for a, b in ((11, 5), (9, 9), (12, 3), (7, 10))]
    rollouts = make_backend("hf", model, tok).generate(
        prompts, 1, SamplingParams(temperature=0, max_tokens=40, stop=[])
    )
    assert all("The answer is" in r.response for r in rollouts)
    stopped = [r.finish_reason == "eos" and len(r.response_ids) < 12 for r in rollouts]
    # with the eos appended the model ends its answer; without it, it runs on to the limit
    assert all(stopped) if append_eos else not any(stopped), [r.response for r in rollouts]


def test_grpo_on_the_real_model_sampler_and_trainer_agree_on_every_step(smollm2_dir, tmp_path):
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo

    cfg = GRPOConfig(model=str(smollm2_dir), task="arithmetic", task_options={"num_ops": 1}, task_train_size=40,
                     dtype="float32",  # the fp32 agreement asserted below (dtype auto is bf16 on AMX/AVX-512 BF16)
                     run_dir=str(tmp_path / "g"), n_grpo_steps=3, rollout_batch_size=8, group_size=4,
                     train_batch_size=4, gradient_accumulation_steps=2, epochs_per_rollout_batch=1, learning_rate=1e-5,
                     warmup_steps=0, sampling_max_tokens=24, sampling_min_tokens=1, eval_examples=4,
                     show_progress=False, device="cpu", log_generations_samples=2)
    train_grpo(cfg)
    records = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "health/logprob_mismatch_tokens" in r]
    assert len(steps) == 3
    # off-policy (train_batch_size < rollout_batch_size): old log-probs of every sampled token, each step
    for r in steps:
        assert r["health/logprob_mismatch_tokens"] > 0 and r["health/logprob_mismatch"] < 1e-4, r
    config = (tmp_path / "g" / "config.yaml").read_text()
    assert "prompt_template: null" in config  # chosen at run time: the chat template (chat_r1)
    sample = json.loads((tmp_path / "g" / "samples" / "eval_step_0.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].endswith("<|im_start|>assistant\n<think>")


def test_a_lora_runs_final_adapter_loads_in_grpolab_eval(smollm2_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpolab.algorithms.sft import SFTConfig, train_sft
    from grpolab.models import load_model_and_tokenizer

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in _stop_pairs()[:16]))
    cfg = SFTConfig(model=str(smollm2_dir), task=None, train_data=str(data), run_dir=str(tmp_path / "lora"),
                    n_sft_steps=2, train_batch_size=8, gradient_accumulation_steps=2, learning_rate=1e-3,
                    warmup_steps=0, lora_r=8, show_progress=False, device="cpu")
    final = train_sft(cfg).final_dir
    assert (final / "adapter_config.json").is_file() and not (final / "config.json").exists()
    # grpolab's loader: base + adapter, merged; equal to peft's own unmerged forward
    merged, tok = load_model_and_tokenizer(str(final))
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(smollm2_dir)), str(final)).eval()
    ids = tok(["Q: 3 plus 4\nA: The answer is"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(str(smollm2_dir))(ids).logits
        torch.testing.assert_close(merged(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)
    assert (merged(ids).logits - base_logits).abs().max() > 1e-3  # the adapter changed the policy
    data_q = _questions(tmp_path / "q.jsonl")
    done = _grpolab(
        "eval",
        "--model",
        final,
        "--data",
        data_q,
        "--n",
        2,
        "--k",
        1,
        "--max-tokens",
        8,
        "--temperature",
        0,
        "--reward",
        "question_only",
        "--no-entropy",
        "--out",
        tmp_path / "eval",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["questions"] == 2


def test_async_grpo_on_the_real_model_samples_in_its_own_process_with_the_trainers_weights(smollm2_dir, tmp_path):
    """max_staleness 1: the sampler process's log-probs of the first batch (version 0, both sides the
    same weights) equal the trainer's; later batches are one version behind, and logged so."""
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo

    cfg = GRPOConfig(model=str(smollm2_dir), task="arithmetic", task_options={"num_ops": 1}, task_train_size=40,
                     dtype="float32",  # the fp32 agreement asserted below (dtype auto is bf16 on AMX/AVX-512 BF16)
                     run_dir=str(tmp_path / "a"), n_grpo_steps=3, rollout_batch_size=8, group_size=4,
                     train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-4, warmup_steps=0,
                     sampling_max_tokens=24, sampling_min_tokens=1, eval_examples=4, show_progress=False,
                     device="cpu", max_staleness=1, threads=1, skip_zero_advantage=False)
    train_grpo(cfg)
    steps = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
             if '"train/reward"' in line]
    assert [s["async/staleness_max"] for s in steps] == [0, 1, 1]
    assert steps[0]["health/logprob_mismatch_tokens"] > 0 and steps[0]["health/logprob_mismatch"] < 1e-4, steps[0]
    assert all("async/behaviour_logprob_gap" in s for s in steps[1:])  # stale batches: the lag, not a mismatch
