"""grpolab.algorithms.ppo: the value head, per-token rewards and GAE, the clipped update with its
KL early stop, the adaptive KL coefficient, and the trainer."""

import copy
import math
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file

import grpolab.algorithms.ppo as ppo
from grpolab.algorithms.grpo import GRPOConfig
from grpolab.algorithms.ppo import (
    PolicyWithValue,
    PPOConfig,
    ValueHead,
    ppo_minibatch_step,
    ppo_update,
    score_tokens,
    train_ppo,
)
from grpolab.core import build_sequences, get_response_log_probs, kl_k1
from grpolab.rollout import HFRolloutBackend, SamplingParams
from grpolab.training.metric_logging import read_metrics
from grpolab.training.optimization import make_optimizer, make_scheduler

CPU = torch.device("cpu")
RUN = dict(rollout_batch_size=16, group_size=2, train_batch_size=8, ppo_epochs=2, learning_rate=1e-3,
           reward="tests.helpers.reward_fixtures:length_parity")  # rewards that vary: the updates move the weights


def _sampled_batch(model, tok, n_prompts=8, group_size=2):
    backend = HFRolloutBackend(model, tok)
    rollouts = backend.generate([f"Q: {i}+{i}\nA: <think>" for i in range(n_prompts)], group_size,
                                SamplingParams(max_tokens=8, min_tokens=1, seed=0))
    return build_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], tok.pad_token_id)


# ---------------------------------------------------------------- config
def test_ppo_has_its_own_defaults_for_the_shared_fields():
    cfg = PPOConfig()
    assert (cfg.rollout_batch_size, cfg.group_size, cfg.train_batch_size, cfg.gradient_accumulation_steps) == (64, 1,
                                                                                                               32, 1)
    assert (cfg.kl_coef, cfg.kl_adaptive, cfg.kl_target, cfg.whiten_advantages, cfg.warmup_steps) == (0.2, True, 6.0,
                                                                                                      True, 0)
    assert PPOConfig(group_size=2).group_size == 2  # a given value wins over the method default
    assert GRPOConfig().group_size == 8 and GRPOConfig().kl_coef == 0.0  # GRPO keeps CS336's


# ---------------------------------------------------------------- the policy with a value head
def test_value_head_starts_at_zero_and_log_probs_are_tempered(tiny_model):
    model, tok = tiny_model()
    assert torch.equal(ValueHead(8)(torch.randn(2, 3, 8)), torch.zeros(2, 3))
    policy = PolicyWithValue(model, temperature=0.7)
    batch = build_sequences([[5, 6, 7], [5]], [[8, 9], [10, 11, 12]], tok.pad_token_id)
    with torch.no_grad():
        lp, entropy, values = policy(batch["input_ids"], batch["labels"], return_entropy=True)
        expected = get_response_log_probs(model, batch["input_ids"], batch["labels"], temperature=0.7)["log_probs"]
    assert torch.allclose(lp, expected, atol=1e-6)
    assert torch.equal(values, torch.zeros_like(lp)) and entropy.shape == lp.shape


def test_ppo_value_loss_falls_on_a_fixed_batch(tiny_model, small_run):
    model, tok = tiny_model()
    policy = PolicyWithValue(model)
    batch = build_sequences([[5, 6, 7]] * 4, [[8, 9], [10], [11, 12, 13], [9]], tok.pad_token_id)
    mask = batch["response_mask"]
    with torch.no_grad():
        old_lp, _, old_v = policy(batch["input_ids"], batch["labels"])
    batch.update(old_log_probs=old_lp, old_values=old_v * mask, advantages=torch.zeros_like(old_lp),
                 returns=torch.linspace(-1.0, 1.0, old_lp.shape[1]).expand_as(old_lp) * mask)
    small_run.pop("task_train_size")
    cfg = PPOConfig(vf_coef=1.0, cliprange_value=None, **small_run)
    opt = make_optimizer(policy, 1e-2)
    losses = []
    for _ in range(30):
        figures = ppo_minibatch_step(policy, batch, cfg, 1, mask.sum())
        losses.append(float(figures["value_loss"] / figures["tokens"]))
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.3 * losses[0]


# ---------------------------------------------------------------- per-token rewards and GAE
def test_score_tokens_rewards_the_last_token_and_penalises_k1_kl_per_token(tiny_model, small_run):
    model, tok = tiny_model(0)
    ref, _ = tiny_model(1)
    policy = PolicyWithValue(model)
    batch = build_sequences([[5, 6, 7], [5, 6]], [[8, 9], [10, 11, 12]], tok.pad_token_id)
    mask = batch["response_mask"]
    score = torch.tensor([1.0, 0.0])
    cfg = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False, **small_run)
    kl = score_tokens(policy, ref, batch, score, 0.5, cfg, CPU, nullcontext)
    with torch.no_grad():
        lp = get_response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]
        ref_lp = get_response_log_probs(ref, batch["input_ids"], batch["labels"])["log_probs"]
    assert torch.allclose(kl, kl_k1(lp, ref_lp) * mask, atol=1e-5)
    assert torch.allclose(batch["old_log_probs"], lp, atol=1e-6)
    # values are 0 (fresh head) and gamma = lam = 1: the return at t is the sum of the rewards from t on
    rewards = -0.5 * kl
    rewards[0, 3] += 1.0  # row 0's last response token (label positions 2, 3)
    expected = rewards.flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(batch["returns"] * mask, expected, atol=1e-5)
    assert torch.allclose(batch["advantages"] * mask, expected, atol=1e-5)
    # without a reference model there is no KL term: only the score, at the last token
    plain = build_sequences([[5, 6, 7], [5, 6]], [[8, 9], [10, 11, 12]], tok.pad_token_id)
    assert torch.equal(score_tokens(policy, None, plain, score, 0.5, cfg, CPU, nullcontext), torch.zeros_like(kl))
    assert (plain["returns"][0] * plain["response_mask"][0]).tolist() == [0.0, 0.0, 1.0, 1.0]
    assert (plain["returns"][1] * plain["response_mask"][1]).abs().sum() == 0


# ---------------------------------------------------------------- the update and its KL early stop
def test_ppo_update_kl_early_stop_does_not_apply_the_stopping_minibatch(tiny_model, open_run, tmp_path, small_run,
                                                                        same_weights, monkeypatch):
    model, tok = tiny_model()
    cfg = PPOConfig(**{**RUN, "learning_rate": 1e-2}, kl_stop=1e-9, kl_coef=0.0, run_dir=str(tmp_path / "ppo"),
                    **small_run)
    run = open_run(cfg, model, tok)
    policy = PolicyWithValue(run.model, cfg.policy_temperature)
    batch = _sampled_batch(run.model, tok)
    score = torch.tensor([float(i % 2) for i in range(16)])
    score_tokens(policy, None, batch, score, 0.0, cfg, CPU, nullcontext)
    reference, initial = copy.deepcopy(policy), copy.deepcopy(policy)
    seen = []
    real = ppo.optimizer_batches

    def spy(*args, **kw):
        seen.append(real(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(ppo, "optimizer_batches", spy)
    optimizer = make_optimizer(policy, cfg.learning_rate)
    _, stopped = ppo_update(run, policy, batch, cfg, optimizer, make_scheduler(optimizer, 0, 4), step=0)
    assert stopped and run.train_step == 1
    records = read_metrics(run.metrics_path)
    assert len(records) == 1 and records[0]["train/approx_kl_old_new"] < 1e-9
    assert all(p.grad is None for p in policy.parameters())  # the stopped gradient is dropped
    # the reference: one update on the first minibatch alone, no early stop
    first = seen[0][0]
    monkeypatch.setattr(ppo, "optimizer_batches", lambda *a, **k: [first])
    ref_cfg = cfg.model_copy(update={"kl_stop": None, "ppo_epochs": 1})
    ref_opt = make_optimizer(reference, cfg.learning_rate)
    _, ref_stopped = ppo_update(run, reference, batch, ref_cfg, ref_opt, make_scheduler(ref_opt, 0, 4), step=0)
    assert not ref_stopped
    assert not same_weights(reference, initial), "the first update moved nothing: nothing to tell apart"
    assert same_weights(policy, reference)


# ---------------------------------------------------------------- the trainer
def _adaptive_kl_next(coef, kl, cfg):
    error = min(max(kl / cfg.kl_target - 1.0, -0.2), 0.2)
    return min(max(coef * (1.0 + error * cfg.rollout_batch_size / cfg.kl_horizon), cfg.kl_coef_min), cfg.kl_coef_max)


def _first_minibatch_only(real):
    """``optimizer_batches`` that gives each PPO step only its first minibatch (a new generator
    marks a new step)."""
    state = {"generator": None}

    def first_only(n_rows, batch_size, shuffle, generator=None, keep_together=None):
        batches = real(n_rows, batch_size, shuffle, generator, keep_together)
        fresh = generator is not state["generator"]
        state["generator"] = generator
        return batches[:1] if fresh else []

    return first_only


def test_ppo_runs_with_gae_adaptive_kl_and_early_stop(tmp_path, small_run, monkeypatch):
    base = dict(RUN, n_ppo_steps=2, kl_horizon=16, eval_examples=1, log_generations_samples=0)
    cfg = PPOConfig(kl_stop=1e-9, run_dir=str(tmp_path / "ppo"), **{**small_run, **base})
    result = train_ppo(cfg)
    records = read_metrics(result.metrics_path)
    steps = [r for r in records if "train/reward" in r]
    updates = [r for r in records if "train/value_loss" in r]
    assert len(steps) == 2 and [r["ppo_step"] for r in updates] == [0, 1]  # the early stop fired in each step ...
    assert all(r["train/kl_early_stop"] == 1 for r in steps) and 0 < steps[0]["train/reward"] < 1
    assert all(math.isfinite(r["train/pg_loss"]) and r["train/approx_kl_old_new"] < 1e-9 for r in updates)
    assert (result.final_dir / "value_head.safetensors").exists()
    # the KL coefficient moved by the controller's rule, from the KL to the reference each step measured
    coef = 0.2
    for r in steps:
        coef = _adaptive_kl_next(coef, r["train/kl_to_ref"], cfg)
        assert r["train/kl_coef"] == pytest.approx(coef, rel=1e-9)
    assert steps[0]["train/kl_coef"] != 0.2
    # ... and the stopped minibatch was not applied: the same weights as a run that only ever takes
    # each step's first minibatch (had the stopped update been applied, or its gradient kept, they differ)
    monkeypatch.setattr(ppo, "optimizer_batches", _first_minibatch_only(ppo.optimizer_batches))
    first_only = train_ppo(cfg.model_copy(update={"kl_stop": None, "run_dir": str(tmp_path / "first_only")}))
    ref_records = read_metrics(first_only.metrics_path)
    assert [r["ppo_step"] for r in ref_records if "train/value_loss" in r] == [0, 1]
    assert all(r["train/kl_early_stop"] == 0 for r in ref_records if "train/reward" in r)
    for name in ("model.safetensors", "value_head.safetensors"):
        a, b = load_file(result.final_dir / name), load_file(first_only.final_dir / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_ppo_without_kl_stop_takes_every_minibatch_of_every_epoch(tmp_path, small_run):
    cfg = PPOConfig(kl_stop=None, kl_coef=0.0, run_dir=str(tmp_path / "ppo"),
                    **{**small_run, **RUN, "n_ppo_steps": 1, "eval_examples": 1})
    records = read_metrics(train_ppo(cfg).metrics_path)
    updates = [r for r in records if "train/value_loss" in r]
    assert [(r["epoch"]) for r in updates] == [0, 0, 1, 1]  # 2 epochs x 16 / 8 minibatches
    step = [r for r in records if "train/reward" in r][0]
    assert step["train/kl_early_stop"] == 0 and step["train/kl_coef"] == 0.0 and step["train/kl_to_ref"] == 0.0


def test_ppo_resume_matches_uninterrupted(tmp_path, small_run):
    base = dict(RUN, checkpoint_every=2, **small_run)
    full = train_ppo(PPOConfig(n_ppo_steps=4, run_dir=str(tmp_path / "full"), **base))
    part = PPOConfig(n_ppo_steps=2, run_dir=str(tmp_path / "part"), **base)
    train_ppo(part)
    resumed = train_ppo(part.model_copy(update={"n_ppo_steps": 4}), resume=True)
    a = load_file(full.final_dir / "model.safetensors")
    b = load_file(resumed.final_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    va = load_file(full.final_dir / "value_head.safetensors")
    vb = load_file(resumed.final_dir / "value_head.safetensors")
    assert all(torch.equal(va[k], vb[k]) for k in va)
