"""grpolab.algorithms.sft: tokenisation, the response-only gradient, filtering, and the trainer."""

import json
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file

from grpolab.algorithms.sft import SFTConfig, accumulate_sft_gradient, sft_pairs, tokenize_pairs, train_sft
from grpolab.data import SFTPair
from grpolab.training.config import ConfigError
from grpolab.training.metric_logging import read_metrics
from tests.helpers.sft_reference import hand_sft_gradient

CPU = torch.device("cpu")


@pytest.fixture
def sft_config(tmp_path):
    def make(**kw):
        base = dict(n_sft_steps=30, learning_rate=3e-3, train_batch_size=16, gradient_accumulation_steps=2,
                    warmup_steps=0, eval_examples=8, sampling_max_tokens=24, run_dir=str(tmp_path / "sft"),
                    show_progress=False, task_train_size=64, device="cpu")
        base.update(kw)
        return SFTConfig(**base)

    return make


# ---------------------------------------------------------------- units
def test_tokenize_pairs_tokenises_prompt_and_response_separately(char_tokenizer):
    pairs = [SFTPair("Q: 1+2\nA: <think>", "3</think> <answer>3</answer>"), SFTPair("ab", "c")]
    out = tokenize_pairs(pairs, char_tokenizer)
    assert out[1] == (char_tokenizer("ab", add_special_tokens=False)["input_ids"], char_tokenizer("c")["input_ids"],
                      None)
    prompt, response, mask = out[0]
    assert mask is None  # every response token is trained on
    assert char_tokenizer.decode(prompt) == pairs[0].prompt and char_tokenizer.decode(response) == pairs[0].response
    assert response[:1] == char_tokenizer("3", add_special_tokens=False)["input_ids"]  # no BOS inserted


@pytest.mark.parametrize("accumulation", [1, 2])
def test_accumulate_sft_gradient_is_the_response_only_nll_gradient(tiny_model, accumulation):
    model, tok = tiny_model()
    eos = tok.eos_token_id
    sequences = [([5, 6, 7], [8, 9, eos]), ([5, 10], [11, 12, 13, 14, eos])]
    model.zero_grad(set_to_none=True)
    loss, nll, tokens = accumulate_sft_gradient(model, sequences, accumulation, 2.0, tok.pad_token_id, CPU, nullcontext)
    grads = [p.grad.clone() for p in model.parameters()]
    expected_loss, expected = hand_sft_gradient(model, sequences, 2.0)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert tokens == 3 + 5 and nll == pytest.approx(expected_loss * 2.0 * 2, rel=1e-5)
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, atol=1e-6)
    # the prompt is not trained on: a gradient over prompt + response differs
    _, with_prompt = hand_sft_gradient(model, [([5], [6, 7, 8, 9, eos]), ([5], [10, 11, 12, 13, 14, eos])], 2.0)
    assert not all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, with_prompt))


def test_tool_demonstrations_replay_the_live_tool_and_train_only_the_models_tokens(tiny_model, char_tokenizer):
    from grpolab.envs import build_env

    env = build_env(["calculate"], max_turns=2)
    pairs = [
        SFTPair("Q: 12*3\nA: <think>", "<calculate>12*3</calculate><result>999</result></think> <answer>36</answer>")
    ]
    (prompt, response, mask), = tokenize_pairs(pairs, char_tokenizer, env)
    enc = lambda text: char_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    call, observation, answer = (enc("<calculate>12*3</calculate>"), enc("<result>36</result>"),
                                 enc("</think> <answer>36</answer>"))
    assert response == call + observation + answer  # the live tool's observation, not the one written in the demo
    assert mask == [True] * len(call) + [False] * len(observation) + [True] * len(answer)
    model, tok = tiny_model()
    sequences = [(prompt, response, mask), ([5, 6], [7, 8, 9, tok.eos_token_id], None)]
    loss, nll, tokens = accumulate_sft_gradient(model, sequences, 2, 1.0, tok.pad_token_id, CPU, nullcontext)
    grads = [p.grad.clone() for p in model.parameters()]
    expected_loss, expected = hand_sft_gradient(model, sequences, 1.0)
    assert tokens == len(call) + len(answer) + 4 and loss == pytest.approx(expected_loss, rel=1e-5)
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, atol=1e-6)
    _, unmasked = hand_sft_gradient(model, [(prompt, response), sequences[1]], 1.0)  # observations trained on
    assert not all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, unmasked))


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_sft_with_an_env_learns_to_call_the_tool(tmp_path):
    from grpolab.envs import EnvBackend, build_env
    from grpolab.models import load_model_and_tokenizer
    from grpolab.rollout import SamplingParams, make_backend
    from tests.helpers.tool_models import ENV, QUESTIONS, tool_prompts, tool_using_model

    model, tok = load_model_and_tokenizer(str(tool_using_model(tmp_path)))  # train_sft with env on an sft.jsonl
    out = EnvBackend(make_backend("hf", model, tok), build_env(**ENV)).generate(
        tool_prompts(), 1, SamplingParams(temperature=0.0, max_tokens=40, stop=["</answer>"]))
    assert sum(r.info["tool_calls"] == 1 and r.info["observation_tokens"] > 0 for r in out) >= 6
    assert sum(r.response.endswith(f"<answer>{a * b}</answer>") for r, (a, b) in zip(out, QUESTIONS)) >= 6


def test_sft_pairs_filters_by_the_verifier_and_caps(sft_config, tmp_path):
    data = tmp_path / "sft.jsonl"
    with open(data, "w") as f:
        for i in range(6):
            answer = i + 1 if i % 3 else i + 2  # rows 0 and 3 answer wrongly
            f.write(json.dumps({"prompt": f"Q: {i}+1\nA: <think>", "ground_truth": str(i + 1),
                                "response": f"{i}+1={i + 1}</think> <answer>{answer}</answer>"}) + "\n")
    cfg = sft_config(task=None, train_data=str(data), reward="arithmetic", filter_correct=True)
    pairs, _ = sft_pairs(cfg)
    assert [p.ground_truth for p in pairs] == ["2", "3", "5", "6"]
    capped, _ = sft_pairs(cfg.model_copy(update={"max_examples": 3}))
    assert [p.ground_truth for p in capped] == ["2", "3", "5"]
    unfiltered, _ = sft_pairs(cfg.model_copy(update={"filter_correct": False}))
    assert len(unfiltered) == 6


def test_sft_config_errors():
    with pytest.raises(ConfigError, match="train_batch_size"):
        SFTConfig.build(None, {"train_batch_size": 10, "gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match="exactly one of task"):
        SFTConfig.build(None, {"train_data": "x.jsonl", "task": "arithmetic"})  # both given explicitly
    assert SFTConfig.build(None, {"train_data": "x.jsonl"}).task is None  # a file alone: no embedded task


# ---------------------------------------------------------------- trainer
def test_sft_loss_falls_and_writes_run(sft_config):
    result = train_sft(sft_config())
    records = read_metrics(result.metrics_path)
    nll = [r["train/token_nll"] for r in records if "train/token_nll" in r]
    assert len(nll) == 30 and sum(nll[-5:]) / 5 < 0.6 * sum(nll[:3]) / 3
    assert (result.final_dir / "model.safetensors").exists()
    assert "accuracy" in result.after
    assert [r["sft_step"] for r in records if "eval_step" in r] == [30]  # eval_every 0: only at the end


def test_filter_correct_and_max_examples(sft_config, tmp_path):
    opts = {"wrong_fraction": 0.5}
    all_pairs = train_sft(sft_config(n_sft_steps=1, task_options=opts, run_dir=str(tmp_path / "a")))
    kept = train_sft(sft_config(n_sft_steps=1, task_options=opts, filter_correct=True, run_dir=str(tmp_path / "b")))
    assert all_pairs.n_examples == 64 and 15 < kept.n_examples < 50
    from grpolab.training.inputs import load_sft_inputs

    pairs, inputs = load_sft_inputs(sft_config(task_options=opts))
    right = sum(inputs.reward(p.response, p.ground_truth)["reward"] >= 1.0 for p in pairs)
    assert kept.n_examples == right  # exactly the pairs the verifier accepts
    capped = train_sft(sft_config(n_sft_steps=1, max_examples=10, run_dir=str(tmp_path / "c")))
    assert capped.n_examples == 10


def test_sft_on_cs336_style_jsonl(sft_config, tmp_path):
    data = tmp_path / "sft.jsonl"
    with open(data, "w") as f:
        for i in range(20):
            f.write(
                json.dumps(
                    {"prompt": f"Q: {i}+1\nA: <think>", "response": f"{i}+1={i + 1}</think> <answer>{i + 1}</answer>",
                     "ground_truth": str(i + 1)}
                )
                + "\n"
            )
    result = train_sft(sft_config(task=None, train_data=str(data), n_sft_steps=3, reward="arithmetic",
                                  filter_correct=True))
    assert result.n_examples == 20


def test_sft_on_a_gsm8k_file(tmp_path):
    gsm = tmp_path / "mini_gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "Q?", "answer": "1 + 1 = <<1+1=2>>2\n#### 2"}) + "\n")
    sft = train_sft(SFTConfig(task=None, train_data=str(gsm), n_sft_steps=1, train_batch_size=1,
                              gradient_accumulation_steps=1, prompt_template="r1_zero", run_dir=str(tmp_path / "sft"),
                              show_progress=False, device="cpu"))
    assert sft.n_examples == 1


def test_sft_resume_matches_uninterrupted(sft_config, tmp_path):
    full = train_sft(sft_config(n_sft_steps=6, checkpoint_every=3, run_dir=str(tmp_path / "full"), eval_examples=2,
                                lr_schedule="constant"))
    part = sft_config(n_sft_steps=3, checkpoint_every=3, run_dir=str(tmp_path / "part"), eval_examples=2,
                      lr_schedule="constant")
    train_sft(part)
    resumed = train_sft(part.model_copy(update={"n_sft_steps": 6}), resume=True)
    a = load_file(full.final_dir / "model.safetensors")
    b = load_file(resumed.final_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["train_step"] for r in read_metrics(resumed.metrics_path) if "train_step" in r]
    assert steps == list(range(6))



def test_sft_length_chosen_by_validation_stops_at_the_first_validation_that_reaches_the_threshold(sft_config, tmp_path):
    """``stop_at_eval_accuracy``: the run stops at the first periodic validation whose accuracy
    reaches the threshold, with exactly the weights the uncapped run had at that step."""
    from safetensors.torch import load_file

    common = dict(n_sft_steps=8, eval_every=2, eval_examples=16, reward="tests.helpers.reward_fixtures:starts_with_7",
                  sampling_max_tokens=4, learning_rate=1e-2)
    full = train_sft(sft_config(**common, checkpoint_every=2, keep_last=4, run_dir=str(tmp_path / "full")))
    curve = {r["sft_step"]: r["eval/accuracy"] for r in read_metrics(full.metrics_path) if "eval/accuracy" in r}
    # the threshold: the best accuracy after the start, which the start does not reach
    threshold = max(a for s, a in curve.items() if s > 0)
    assert curve[0] < threshold, curve
    first = min(s for s, a in curve.items() if a >= threshold)
    capped = train_sft(sft_config(**common, stop_at_eval_accuracy=threshold, run_dir=str(tmp_path / "capped")))
    records = read_metrics(capped.metrics_path)
    assert [r["sft/stopped_at_step"] for r in records if "sft/stopped_at_step" in r] == [first]
    assert max(r["train_step"] for r in records if "train_step" in r) == first - 1  # no step after the stop
    assert capped.after["accuracy"] == pytest.approx(curve[first])
    expected = load_file(full.run_dir / "checkpoints" / f"step_{first}" / "model.safetensors")
    got = load_file(capped.final_dir / "model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    with pytest.raises(ValueError, match="stop_at_eval_accuracy needs eval_every"):
        sft_config(stop_at_eval_accuracy=0.5)
