"""SFT-adjacent methods (expert iteration, PPO, DPO) and the evaluation metrics."""

import json
import math

import pytest
import torch

from grpolab.algorithms.dpo import DPOConfig, compute_per_instance_dpo_loss, train_dpo
from grpolab.algorithms.expert_iteration import EIConfig, train_expert_iteration
from grpolab.algorithms.ppo import (
    PolicyWithValue,
    PPOConfig,
    ppo_minibatch_step,
    train_ppo,
)
from grpolab.algorithms.metrics import read_metrics
from grpolab.algorithms.optimization import make_optimizer
from grpolab.core import build_sequences, compute_dpo_loss, tokenize_prompt_and_output
from grpolab.models import load_model_and_tokenizer

SMALL = dict(sampling_max_tokens=12, sampling_min_tokens=1, eval_examples=4, show_progress=False, device="cpu",
             task_train_size=40)


# ---------------------------------------------------------------- metrics
def test_ppo_value_loss_falls_on_a_fixed_batch():
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    policy = PolicyWithValue(model)
    batch = build_sequences([[5, 6, 7]] * 4, [[8, 9], [10], [11, 12, 13], [9]], tok.pad_token_id)
    mask = batch["response_mask"]
    with torch.no_grad():
        old_lp, _, old_v = policy(batch["input_ids"], batch["labels"])
    batch.update(old_log_probs=old_lp, old_values=old_v * mask, advantages=torch.zeros_like(old_lp),
                 returns=torch.linspace(-1.0, 1.0, old_lp.shape[1]).expand_as(old_lp) * mask)
    cfg = PPOConfig(vf_coef=1.0, cliprange_value=None, **{k: v for k, v in SMALL.items() if k != "task_train_size"})
    opt = make_optimizer(policy, 1e-2)
    losses = []
    for _ in range(30):
        figures = ppo_minibatch_step(policy, batch, cfg, 1, mask.sum())
        losses.append(figures["value_loss"] / figures["tokens"])
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.3 * losses[0]


def test_ppo_runs_with_gae_kl_and_early_stop(tmp_path):
    cfg = PPOConfig(n_ppo_steps=2, rollout_batch_size=16, group_size=2, train_batch_size=8, ppo_epochs=2,
                    learning_rate=1e-3, run_dir=str(tmp_path / "ppo"), **SMALL)
    result = train_ppo(cfg)
    records = read_metrics(result.metrics_path)
    steps = [r for r in records if "train/reward" in r]
    assert len(steps) == 2 and all(0.1 <= r["train/kl_coef"] <= 0.3 for r in steps)
    updates = [r for r in records if "train/value_loss" in r]
    assert updates and all(math.isfinite(r["train/pg_loss"]) for r in updates)
    assert (result.final_dir / "value_head.safetensors").exists()


# ---------------------------------------------------------------- DPO
def test_per_instance_dpo_loss_matches_its_definition():
    lm, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    ref, _ = load_model_and_tokenizer("embedded:tiny", seed=1)
    loss = compute_per_instance_dpo_loss(lm, ref, tok, 0.5, "Q: 2+2", "4", "5")
    from grpolab.algorithms.dpo import ALPACA_TEMPLATE
    from grpolab.core import get_response_log_probs

    def logp(model, response):
        b = tokenize_prompt_and_output([ALPACA_TEMPLATE.format(instruction="Q: 2+2")], [response + tok.eos_token], tok)
        lp = get_response_log_probs(model, b["input_ids"], b["labels"])["log_probs"]
        return (lp * b["response_mask"]).sum()

    with torch.no_grad():
        expected = compute_dpo_loss(logp(lm, "4"), logp(lm, "5"), logp(ref, "4"), logp(ref, "5"), 0.5)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert any(p.grad is not None for p in lm.parameters())
    assert all(p.grad is None for p in ref.parameters())


def test_dpo_preference_accuracy_rises_on_separable_pairs(tmp_path):
    # separable: the chosen response always says "yes", the rejected one "no"
    data = tmp_path / "toy.jsonl"
    with open(data, "w") as f:
        for i in range(200):
            f.write(json.dumps({"prompt": f"Q: {i}?", "chosen": f"yes {i}", "rejected": f"no {i}"}) + "\n")
    cfg = DPOConfig(task=None, train_data=str(data), n_dpo_steps=30, learning_rate=1e-3, beta=0.5, train_batch_size=16,
                    run_dir=str(tmp_path / "dpo"), show_progress=False, device="cpu")
    result = train_dpo(cfg)
    assert result.before["preference_accuracy"] == 0.0  # policy == reference: no margin yet
    assert result.after["preference_accuracy"] >= 0.9
    rows = [r for r in read_metrics(result.metrics_path) if "train/dpo_loss" in r]
    assert rows[-1]["train/dpo_loss"] < rows[0]["train/dpo_loss"]


def test_dpo_on_task_pairs_moves_the_margin(tmp_path):
    result = train_dpo(DPOConfig(n_dpo_steps=5, train_batch_size=4, task_train_size=20, eval_pairs=8, learning_rate=1e-3,
                                 run_dir=str(tmp_path / "t"), show_progress=False, device="cpu"))
    assert result.before["preference_accuracy"] == 0.0 and result.before["reward_margin"] == 0.0
    assert result.after["reward_margin"] != 0.0
    rows = [r for r in read_metrics(result.metrics_path) if "train/dpo_loss" in r]
    assert len(rows) == 5 and rows[0]["train/dpo_loss"] == pytest.approx(math.log(2), rel=1e-4)


def test_dpo_on_a_preference_file(tmp_path):
    data = tmp_path / "pref.jsonl"
    with open(data, "w") as f:
        for i in range(30):
            f.write(json.dumps({"prompt": f"say {i}", "chosen": f"{i}", "rejected": f"{i + 1}"}) + "\n")
    result = train_dpo(DPOConfig(task=None, train_data=str(data), n_dpo_steps=2, train_batch_size=4,
                                 use_alpaca_template=True, run_dir=str(tmp_path / "d"), show_progress=False, device="cpu"))
    assert "preference_accuracy" in result.after


# ---------------------------------------------------------------- expert iteration
def test_expert_iteration_filters_and_trains(tmp_path):
    cfg = EIConfig(n_ei_steps=2, ei_batch_size=8, group_size=4, train_batch_size=4, gradient_accumulation_steps=2,
                   learning_rate=1e-3, run_dir=str(tmp_path / "ei"), reward="tests.reward_fixtures:reward_any_digit", **SMALL)
    result = train_expert_iteration(cfg)
    assert len(result.filtered_sizes) == 2 and all(0 <= s <= 32 for s in result.filtered_sizes)
    records = [r for r in read_metrics(result.metrics_path) if "ei/filtered_size" in r]
    assert [r["ei/filtered_size"] for r in records] == result.filtered_sizes
    assert all("ei/response_entropy" in r for r in records)
    if any(result.filtered_sizes):
        assert any("train/token_nll" in r for r in read_metrics(result.metrics_path))


def reward_any_digit(response, ground_truth):
    r = float(any(ch.isdigit() for ch in response))
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


def test_ppo_resume_matches_uninterrupted(tmp_path):
    from safetensors.torch import load_file

    base = dict(rollout_batch_size=16, group_size=2, train_batch_size=8, ppo_epochs=2, learning_rate=1e-3,
                checkpoint_every=2, **SMALL)
    full = train_ppo(PPOConfig(n_ppo_steps=4, run_dir=str(tmp_path / "full"), **base))
    part = PPOConfig(n_ppo_steps=2, run_dir=str(tmp_path / "part"), **base)
    train_ppo(part)
    resumed = train_ppo(part.model_copy(update={"n_ppo_steps": 4}), resume=True)
    a = load_file(full.final_dir / "model.safetensors")
    b = load_file(resumed.final_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    va = load_file(full.final_dir / "value_head.safetensors")
    vb = load_file(resumed.final_dir / "value_head.safetensors")
    assert all(torch.equal(va[k], vb[k]) for k in va)
