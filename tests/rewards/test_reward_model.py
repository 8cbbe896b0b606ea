"""Learned reward models: the value head on a causal LM, ``reward: {model: PATH}`` scored in batches
(alone and in the weighted list, each component logged, three normalisations, a chosen label),
``grpolab rm`` (Bradley–Terry with a margin, exact resume, an ordinary HF directory) and PPO on a
reward model's score. Tiny models built here; each test a few seconds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.algorithms.rm import RMConfig, pair_rewards, rm_gradient, train_rm
from grpolab.core import compute_bradley_terry_loss
from grpolab.data import PreferencePair
from grpolab.models import load_model_and_tokenizer
from grpolab.models.classifier import load_sequence_classifier, value_head_model
from grpolab.rewards import RewardScorer, build_reward, check_reward_spec
from grpolab.training.config import ConfigError
from grpolab.training.metric_logging import read_metrics

CPU = torch.device("cpu")
PAIRS = [PreferencePair(f"Q: {i}+1=", f"{i + 1}", f"{i + 3}") for i in range(8)]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A saved reward model: the tiny causal LM with a value head, as an ordinary HF directory."""
    lm, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    model = value_head_model(lm, seed=1)
    model.config.pad_token_id = tok.pad_token_id
    path = tmp_path_factory.mktemp("rm") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def direct_scores(path, texts):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    _, tok = load_model_and_tokenizer("embedded:tiny")
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0]) for t in texts]


def test_the_value_head_keeps_the_backbone_and_reads_the_last_real_token(tiny_model):
    lm, tok = tiny_model(0)
    model = value_head_model(lm).eval()
    assert model.config.num_labels == 1 and type(model).__name__ == "LlamaForSequenceClassification"
    assert all(torch.equal(a, b) for a, b in zip(model.model.state_dict().values(), lm.model.state_dict().values()))
    model.config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        alone = model(**tok(["Q: 1+1=2"], return_tensors="pt")).logits[0, 0]
        padded = model(**tok(["Q: 1+1=2", "a much longer text than that"], return_tensors="pt", padding=True)).logits[0,
                                                                                                                      0]
    assert torch.allclose(alone, padded, atol=1e-5)  # padding never changes a score


def test_reward_model_scores_are_the_models_own_on_prompt_plus_response(rm_dir):
    with RewardScorer({"model": str(rm_dir), "batch_size": 2}, device=CPU) as scorer:
        assert scorer.mode == "model"
        scores = scorer.score(["2", "3", "17"], [None] * 3, prompts=["Q: 1+1=", "Q: 1+1=", "Q: 9+8="])
    expected = direct_scores(rm_dir, ["Q: 1+1=2", "Q: 1+1=3", "Q: 9+8=17"])
    assert [s["rm"] for s in scores] == pytest.approx(expected, abs=1e-5)
    assert [s["reward"] for s in scores] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="prompts"):
        RewardScorer({"model": str(rm_dir)}).score(["2"], [None])


def test_weighted_list_mixes_a_rule_and_a_reward_model_and_logs_each(rm_dir):
    spec = [{"fn": "arithmetic", "weight": 2.0, "key": "answer_reward", "name": "verifier"},
            {"model": str(rm_dir), "weight": 0.5, "name": "judge"}]
    responses = ["x</think> <answer>2</answer>", "x</think> <answer>5</answer>"]
    with RewardScorer(spec, device=CPU) as scorer:
        scores = scorer.score(responses, ["2", "2"], prompts=["Q: 1+1=", "Q: 1+1="])
    raw = direct_scores(rm_dir, ["Q: 1+1=" + r for r in responses])
    for s, verified, judge in zip(scores, (1.0, 0.0), raw):
        assert s["verifier"] == verified and s["judge_raw"] == pytest.approx(judge, abs=1e-5)
        assert s["reward"] == pytest.approx(2.0 * verified + 0.5 * judge, abs=1e-5)
        assert s["answer_reward"] == verified  # the rule's figures still reach the health checks


def test_normalisations_batch_running_and_none(rm_dir):
    prompts, responses = ["Q: 1+1="] * 4, ["1", "2", "3", "44"]
    batch = RewardScorer({"model": str(rm_dir), "normalize": "batch"}, device=CPU).score(responses, [None] * 4, prompts)
    values = torch.tensor([s["rm"] for s in batch])
    assert abs(float(values.mean())) < 1e-5 and float(values.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    running = RewardScorer({"model": str(rm_dir), "normalize": "running"}, device=CPU)
    running.score(responses[:2], [None] * 2, prompts[:2])
    second = running.score(responses[2:], [None] * 2, prompts[2:])
    raws = [s["rm_raw"] for s in batch]
    mean, std = sum(raws) / 4, math.sqrt(sum((r - sum(raws) / 4) ** 2 for r in raws) / 4)
    assert [s["rm"] for s in second] == pytest.approx([(r - mean) / (std + 1e-6) for r in raws[2:]], abs=1e-4)
    state = running.state_dict()
    assert state["rm"]["count"] == 4 and json.loads(json.dumps(state)) == state  # checkpointable as it is
    restored = RewardScorer({"model": str(rm_dir), "normalize": "running"}, device=CPU)
    restored.load_state_dict(state)
    assert restored.state_dict() == state


def test_a_chosen_label_of_a_multi_label_model(tmp_path, tiny_model):
    lm, tok = tiny_model(0)
    model = value_head_model(lm, num_labels=2, seed=3)
    model.config.pad_token_id, model.config.id2label = tok.pad_token_id, {0: "bad", 1: "good"}
    model.config.label2id = {"bad": 0, "good": 1}
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    with torch.no_grad():
        logits = model(**tok("Q: 1+1=2", return_tensors="pt")).logits[0]
    good = RewardScorer({"model": str(tmp_path / "m"), "label": "good"}, device=CPU).score(["2"], [None], ["Q: 1+1="])
    prob = RewardScorer({"model": str(tmp_path / "m"), "label": 0, "score": "probability"}, device=CPU).score(
        ["2"], [None], ["Q: 1+1="])
    assert good[0]["rm"] == pytest.approx(float(logits[1]), abs=1e-5)
    assert prob[0]["rm"] == pytest.approx(float(torch.softmax(logits, 0)[0]), abs=1e-5)
    with pytest.raises(ValueError, match="choose one with label"):
        RewardScorer({"model": str(tmp_path / "m")}, device=CPU).score(["2"], [None], ["Q: 1+1="])


def test_reward_model_specs_are_checked_in_one_line(rm_dir, tmp_path):
    assert check_reward_spec({"model": str(rm_dir)}) == {"model": str(rm_dir)}
    for spec, needle in [({"model": str(tmp_path / "none")}, "reward.model: "),
                         ({"model": str(rm_dir), "normalise": "batch"}, "reward.normalise: unknown key"),
                         ([{"fn": "arithmetic"}, {"model": str(rm_dir), "normalize": "z"}], "reward[1].normalize")]:
        with pytest.raises(ConfigError) as err:
            GRPOConfig.build(None, {"reward": spec})
        assert needle in str(err.value) and "\n" not in str(err.value)
    assert build_reward([{"model": str(rm_dir)}]).rule is None


def test_bradley_terry_loss_with_a_margin():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    assert compute_bradley_terry_loss(c, r).tolist() == pytest.approx([math.log1p(math.exp(-1)), math.log1p(math.e)])
    assert compute_bradley_terry_loss(c, r, 1.0).tolist() == pytest.approx([math.log(2), math.log1p(math.exp(2))])


def test_rm_gradient_is_the_mean_pair_loss_gradient_for_any_accumulation(tiny_model):
    lm, tok = tiny_model(0)
    model = value_head_model(lm, seed=2)
    model.config.pad_token_id = tok.pad_token_id
    grads = []
    for accumulation in (1, 4):
        model.zero_grad(set_to_none=True)
        cfg = RMConfig(train_batch_size=8, gradient_accumulation_steps=accumulation, margin=0.5)
        loss, correct, _ = rm_gradient(model, tok, PAIRS, cfg, CPU)
        grads.append([p.grad.clone() for p in model.parameters()])
    with torch.no_grad():
        c, r = pair_rewards(model, tok, PAIRS, RMConfig(), CPU)
    assert loss == pytest.approx(float(compute_bradley_terry_loss(c, r, 0.5).mean()), rel=1e-4)
    assert correct == int((c > r).sum())
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


def _write_pairs(path, n=48):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Q: {i % 9}+1=", "chosen": f"{i % 9 + 1}", "rejected": "no idea"}) + "\n")
    return str(path)


def test_rm_trains_resumes_exactly_and_saves_a_sequence_classifier(tmp_path, same_weights):
    from transformers import AutoModelForSequenceClassification

    data = _write_pairs(tmp_path / "pairs.jsonl")
    common = dict(model="embedded:tiny", train_data=data, train_batch_size=8, learning_rate=3e-3, device="cpu",
                  show_progress=False, eval_pairs=8, checkpoint_every=2)
    whole = train_rm(RMConfig(**common, n_rm_steps=4, run_dir=str(tmp_path / "whole")))
    train_rm(RMConfig(**common, n_rm_steps=2, run_dir=str(tmp_path / "split")))
    split = train_rm(RMConfig(**common, n_rm_steps=4, run_dir=str(tmp_path / "split")), resume=True)
    a = AutoModelForSequenceClassification.from_pretrained(str(whole.final_dir))
    b = AutoModelForSequenceClassification.from_pretrained(str(split.final_dir))
    assert type(a).__name__ == "LlamaForSequenceClassification" and a.config.num_labels == 1
    assert same_weights(a, b)
    rows = read_metrics(whole.metrics_path)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert {"eval/pairwise_accuracy", "eval/reward_margin", "eval/loss"} <= set(rows[-1])
    assert whole.after["pairwise_accuracy"] > whole.before["pairwise_accuracy"]
    model, _ = load_sequence_classifier(str(whole.final_dir))  # and grpolab's own loader takes it as it is
    assert same_weights(model, a)


def test_grpo_and_ppo_train_on_a_reward_models_score(rm_dir, grpo_config, tmp_path):
    from grpolab.algorithms.grpo import train_grpo
    from grpolab.algorithms.ppo import PPOConfig, train_ppo

    reward = {"model": str(rm_dir), "normalize": "running"}
    grpo = train_grpo(grpo_config(reward=reward, n_grpo_steps=1, checkpoint_every=1))
    rows = [r for r in read_metrics(grpo.metrics_path) if "train/reward" in r]
    assert rows and "train/reward_rm_raw" in rows[0] and rows[0]["health/reward_errors"] == 0
    assert "eval/accuracy" in read_metrics(grpo.metrics_path)[-1]  # validation: the task's verifier
    # a reward model alone has no answer check to be compared with: no agreement figure (never a vacuous 1.0)
    assert "health/reward_answer_agreement" not in rows[0]
    ppo = train_ppo(PPOConfig(reward=reward, n_ppo_steps=1, rollout_batch_size=8, group_size=4, train_batch_size=8,
                              gradient_accumulation_steps=1, sampling_max_tokens=6, sampling_min_tokens=1,
                              eval_examples=2, task_train_size=8, device="cpu", show_progress=False,
                              run_dir=str(tmp_path / "ppo")))
    assert any("train/reward_rm" in r for r in read_metrics(ppo.metrics_path))
