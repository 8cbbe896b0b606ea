"""grpolab.algorithms.grpo: the config's rules, the step's phases (advantages, rollout batch, old
log-probs, the policy update with its KL early stop), and the trainer's properties on tiny runs."""

import copy
import json
import math
import warnings
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file

import grpolab.algorithms.grpo_update as grpo_update
from grpolab.algorithms.grpo import GRPOConfig, group_advantages, train_grpo
from grpolab.algorithms.grpo_update import accumulate_policy_gradient, policy_update
from grpolab.core import FixedKLController, get_response_log_probs, normalize_group_rewards, policy_loss_names
from grpolab.rollout import HFRolloutBackend, Rollout, SamplingParams
from grpolab.training.batching import batched_log_probs, make_rollout_batch
from grpolab.training.config import ConfigError
from grpolab.training.health import UnhealthyRunError
from grpolab.training.metric_logging import read_metrics
from grpolab.training.optimization import make_optimizer, make_scheduler, optimizer_step

CPU = torch.device("cpu")


def train_records(result):
    return [r for r in read_metrics(result.metrics_path) if "train_step" in r]


def step_records(result):
    """The first record of each GRPO step (it carries the rollout figures)."""
    return [r for r in read_metrics(result.metrics_path) if "train/reward" in r]


def final_weights(result):
    return load_file(result.final_dir / "model.safetensors")


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "over,message",
    [
        (dict(train_batch_size=10, gradient_accumulation_steps=4),
         "train_batch_size (10) must be divisible by gradient_accumulation_steps (4)"),
        (dict(rollout_batch_size=10, group_size=4), "rollout_batch_size (10) must be divisible by group_size (4)"),
        (dict(learning_rate=-1), "'learning_rate'"),
        (dict(loss_type="ppo"), "'loss_type'"),
        (dict(banana=1), "unknown key 'banana'"),
        (dict(train_batch_size=4, group_size=8, rollout_batch_size=16, gradient_accumulation_steps=1),
         "train_batch_size (4) must be at least group_size (8)"),
    ],
)
def test_config_errors_name_the_key(over, message):
    with pytest.raises(ConfigError) as err:
        GRPOConfig.build(None, over)
    assert message in str(err.value)


def test_unknown_loss_type_lists_the_registered_names():
    with pytest.raises(ConfigError) as err:
        GRPOConfig.build(None, {"loss_type": "ppo"})
    names = policy_loss_names()
    assert {"no_baseline", "reinforce_with_baseline", "grpo_clip", "grpo_no_clip"} <= set(names)
    assert f"expected one of {', '.join(names)}" in str(err.value)


def test_k1_as_a_kl_loss_is_refused_because_its_expected_gradient_is_zero():
    with pytest.raises(ConfigError, match=r"kl_estimator 'k1' has zero expected gradient as a loss term.*k2, k3"):
        GRPOConfig.build(None, {"kl_coef": 0.1, "kl_estimator": "k1"})
    assert GRPOConfig(kl_coef=0.0, kl_estimator="k1").kl_estimator == "k1"  # no KL term: nothing to refuse
    assert GRPOConfig(kl_coef=0.1, kl_estimator="k2").kl_estimator == "k2"


def test_greedy_rollouts_are_refused():
    with pytest.raises(ConfigError, match=r"sampling_temperature 0 \(greedy\) with group_size 8"):
        GRPOConfig.build(None, {"sampling_temperature": 0})
    assert GRPOConfig(eval_temperature=0).eval_temperature == 0


def test_grpo_clip_on_policy_warns():
    with pytest.warns(UserWarning, match="on-policy"):
        GRPOConfig(loss_type="grpo_clip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(loss_type="grpo_clip", epochs_per_rollout_batch=2)  # off-policy: the ratio moves, no warning


def test_off_policy_is_more_than_one_optimizer_step_per_rollout_batch():
    assert not GRPOConfig().off_policy
    assert GRPOConfig(epochs_per_rollout_batch=2).off_policy
    assert GRPOConfig(train_batch_size=128, gradient_accumulation_steps=64).off_policy


# ---------------------------------------------------------------- phases
def test_group_advantages_zero_variance_groups_are_exactly_zero_even_with_eps_zero(grpo_config):
    raw = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(raw, grpo_config(advantage_eps=0.0))
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:4], torch.zeros(4)) and torch.equal(adv[8:12], torch.zeros(4))
    std = torch.tensor([0.0, 1.0, 0.0, 0.0]).std()
    assert adv[4:8].tolist() == pytest.approx(((torch.tensor([0.0, 1, 0, 0]) - 0.25) / std).tolist(), rel=1e-6)
    plain = group_advantages(raw, grpo_config(use_std_normalization=False))
    assert plain[4:8].tolist() == pytest.approx([-0.25, 0.75, -0.25, -0.25])
    whitened = group_advantages(raw, grpo_config(whiten_advantages=True))
    assert whitened.mean().item() == pytest.approx(0.0, abs=1e-6) and whitened.std().item() == pytest.approx(1.0,
                                                                                                             rel=1e-3)


def _rollout(prompt_ids, response_ids, logprobs, prompt_index=0, finish="stop"):
    return Rollout("p", "r", prompt_ids, response_ids, logprobs, finish, prompt_index)


def test_make_rollout_batch_keeps_the_exact_ids_and_places_sampler_log_probs_at_label_positions():
    rollouts = [_rollout([5, 6, 7], [8, 9], [-0.5, -1.5]), _rollout([5, 6], [10, 11, 12], [-1.0, -2.0, -3.0], 1)]
    raw, adv = torch.tensor([1.0, 0.0]), torch.tensor([0.5, -0.5])
    batch = make_rollout_batch(rollouts, raw, adv, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, 10, 11]]
    assert batch.labels.tolist() == [[6, 7, 8, 9], [6, 10, 11, 12]]
    assert batch.response_mask.tolist() == [[False, False, True, True], [False, True, True, True]]
    assert batch.sampler_log_probs.tolist() == [[0.0, 0.0, -0.5, -1.5], [0.0, -1.0, -2.0, -3.0]]
    assert batch.sequences == [([5, 6, 7], [8, 9], 0), ([5, 6], [10, 11, 12], 1)]
    t = batch.tensors()
    assert t["advantages"].shape == (2, 1) and t["raw_rewards"].shape == (2, 1) and "old_log_probs" not in t


def test_batched_log_probs_are_the_tempered_log_probs_of_each_row(tiny_model):
    model, tok = tiny_model()
    rollouts = [_rollout([5, 6, 7], [8, 9], [0.0, 0.0]), _rollout([5, 6], [10, 11, 12], [0.0] * 3, 1),
                _rollout([9], [13], [0.0], 2)]
    batch = make_rollout_batch(rollouts, torch.zeros(3), torch.zeros(3), tok.pad_token_id)
    out = batched_log_probs(model, batch, 2, CPU, nullcontext, temperature=0.6)
    with torch.no_grad():
        for i, (p, r, _) in enumerate(batch.sequences):
            ids = torch.tensor([p + r])
            lp = get_response_log_probs(model, ids[:, :-1], ids[:, 1:], temperature=0.6)["log_probs"][0]
            mask = batch.response_mask[i, : lp.shape[0]]
            assert torch.allclose(out[i, : lp.shape[0]][mask], lp[mask], atol=1e-5)
    assert not torch.allclose(out, batched_log_probs(model, batch, 2, CPU, nullcontext, temperature=1.0))


# ---------------------------------------------------------------- gradient equality
def _rollout_batch(group_size=4, n_prompts=4, seed=0, model_and_tok=None):
    from grpolab.models import load_model_and_tokenizer

    model, tok = model_and_tok or load_model_and_tokenizer("embedded:tiny", seed=seed)
    backend = HFRolloutBackend(model, tok)
    prompts = [f"Q: {i}+{i}\nA: <think>" for i in range(n_prompts)]
    rollouts = backend.generate(prompts, group_size, SamplingParams(max_tokens=12, min_tokens=1, seed=seed))
    raw = torch.tensor([float(len(r.response_ids) % 3 == 0) for r in rollouts])
    raw[:group_size] = 1.0  # one zero-variance group
    batch = make_rollout_batch(rollouts, raw, normalize_group_rewards(raw, group_size, 1e-6, True), tok.pad_token_id)
    return model, tok, batch


def _grad(model, batch, cfg, contributes, shared=False):
    """The gradient of one optimizer batch over every row; ``shared``: each prompt run once."""
    model.zero_grad(set_to_none=True)
    n = batch.labels.shape[0]
    cfg = cfg.model_copy(update={"share_prompt_prefix": bool(shared)})
    accumulate_policy_gradient(model, batch, list(range(n)), cfg, contributes, 0.0, CPU, nullcontext)
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


@pytest.mark.parametrize("mode", ["masked_mean", "masked_normalize", "token_mean"])
def test_dynamic_microbatching_and_skipping_leave_the_gradient_unchanged(grpo_config, mode):
    model, _, batch = _rollout_batch()
    n = batch.labels.shape[0]
    fixed = grpo_config(rollout_batch_size=n, train_batch_size=n, gradient_accumulation_steps=4,
                        length_normalization=mode, skip_zero_advantage=False)
    all_rows = torch.ones(n, dtype=torch.bool)
    reference = _grad(model, batch, fixed, all_rows)
    assert reference.abs().sum() > 0
    dynamic = fixed.model_copy(update={"micro_batch_token_budget": 40})
    assert torch.allclose(_grad(model, batch, dynamic, all_rows), reference, atol=1e-6)
    one_big = fixed.model_copy(update={"gradient_accumulation_steps": 1})
    assert torch.allclose(_grad(model, batch, one_big, all_rows), reference, atol=1e-6)
    skip = batch.advantages != 0
    assert not skip.all()
    assert torch.allclose(_grad(model, batch, dynamic, skip), reference, atol=1e-6)
    # each prompt computed once for its group: the same gradient
    assert torch.allclose(_grad(model, batch, fixed, all_rows, True), reference, atol=1e-6)
    assert torch.allclose(_grad(model, batch, dynamic, skip, True), reference, atol=1e-6)
    assert torch.allclose(_grad(model, batch, one_big, skip, True), reference, atol=1e-6)


def test_empty_response_never_reaches_the_loss_as_nan(grpo_config):
    model, _, batch = _rollout_batch()
    n = batch.labels.shape[0]
    batch.response_mask[1] = False  # row 1 as if the response were empty
    cfg = grpo_config(rollout_batch_size=n, train_batch_size=n, gradient_accumulation_steps=2)
    g = _grad(model, batch, cfg, batch.response_mask.any(1))
    assert torch.isfinite(g).all() and g.abs().sum() > 0


# ---------------------------------------------------------------- the policy update and its KL early stop
def test_policy_update_kl_early_stop_applies_only_the_first_optimizer_step(grpo_config, open_run, weights,
                                                                           same_weights, monkeypatch):
    """Off-policy (two optimizer batches per rollout batch) with a tiny kl_stop: the first batch has
    approx KL(old || current) = 0 (old == current) and is applied; the second, measured after that
    step, exceeds kl_stop, is not applied, and leaves no gradient behind."""
    model, tok, batch = _rollout_batch()
    n = len(batch.sequences)
    batch.raw_rewards = torch.tensor([float(i % 2) for i in range(n)])  # every group varies: every row trains
    batch.advantages = normalize_group_rewards(batch.raw_rewards, 4, 1e-6, True)
    cfg = grpo_config(rollout_batch_size=n, train_batch_size=n // 2, gradient_accumulation_steps=2, kl_stop=1e-9,
                      learning_rate=1e-2)
    run = open_run(cfg, model, tok)
    reference, initial = copy.deepcopy(run.model), weights(run.model)
    batch.old_log_probs = batched_log_probs(run.model, batch, 4, CPU, nullcontext, cfg.policy_temperature)
    seen = []
    real = grpo_update.optimizer_batches

    def spy(*args, **kw):
        seen.append(real(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(grpo_update, "optimizer_batches", spy)
    optimizer = make_optimizer(run.model, cfg.learning_rate, cfg.betas)
    scheduler = make_scheduler(optimizer, 0, 4)
    update = policy_update(run, batch, cfg, optimizer, scheduler, FixedKLController(0.0), False, step=0)
    assert update.stopped_early and len(update.records) == 1
    assert update.records[0]["train/approx_kl_old_new"] < 1e-9 and run.train_step == 1
    assert all(p.grad is None for p in run.model.parameters())  # the stopped gradient is dropped
    # the same weights as one optimizer step on the first optimizer batch alone
    first_rows = seen[0][0]
    contributes = batch.response_mask.any(1) & (batch.advantages != 0)
    ref_opt = make_optimizer(reference, cfg.learning_rate, cfg.betas)
    sums = accumulate_policy_gradient(reference, batch, first_rows, cfg, contributes, 0.0, CPU, nullcontext)
    optimizer_step(reference, ref_opt, make_scheduler(ref_opt, 0, 4), cfg.max_grad_norm, sums["loss"])
    assert not same_weights(reference.state_dict(), initial), "the first step moved nothing: nothing to tell apart"
    assert same_weights(run.model.state_dict(), reference.state_dict())


# ---------------------------------------------------------------- trainer runs
def test_learns_a_trivially_learnable_reward(grpo_config):
    cfg = grpo_config(n_grpo_steps=25, rollout_batch_size=64, group_size=8, train_batch_size=64,
                      gradient_accumulation_steps=1, sampling_max_tokens=3, learning_rate=1e-2,
                      reward="tests.helpers.reward_fixtures:starts_with_7", seed=1)
    result = train_grpo(cfg)
    rewards = [r["train/reward"] for r in step_records(result)]
    assert len(rewards) == 25
    assert sum(rewards[:3]) / 3 < 0.2
    assert sum(rewards[-5:]) / 5 > 0.6, rewards
    final = result.final_dir
    assert (final / "model.safetensors").exists() and (final / "tokenizer.json").exists()
    assert (result.run_dir / "curves.png").stat().st_size > 1000


def _adaptive_kl_next(coef, kl, cfg):
    """Ziegler et al.'s controller, written out: the coefficient after one rollout batch."""
    error = min(max(kl / cfg.kl_target - 1.0, -0.2), 0.2)
    return min(max(coef * (1.0 + error * cfg.rollout_batch_size / cfg.kl_horizon), cfg.kl_coef_min), cfg.kl_coef_max)


@pytest.mark.parametrize("variant", [
    dict(loss_type="reinforce_with_baseline"),
    dict(loss_type="grpo_clip", epochs_per_rollout_batch=2, train_batch_size=8, gradient_accumulation_steps=2),
    dict(loss_type="no_baseline", length_normalization="masked_normalize"),
    dict(loss_type="grpo_no_clip", epochs_per_rollout_batch=2, length_normalization="token_mean", cliprange_high=0.28),
    dict(kl_coef=0.2, kl_adaptive=True, kl_target=0.01, kl_horizon=16, loss_type="grpo_clip",
         epochs_per_rollout_batch=2, micro_batch_token_budget=64),
])
def test_variants_run_and_log(grpo_config, variant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = grpo_config(**variant)
        result = train_grpo(cfg)
    records = read_metrics(result.metrics_path)
    train = [r for r in records if "train_step" in r]
    per_rollout = (16 // cfg.train_batch_size) * cfg.epochs_per_rollout_batch
    first = [r for r in train if "train/reward" in r]
    assert [r["grpo_step"] for r in first] == [0, 1, 2]
    for r in first:  # every optimizer step of a rollout batch is applied, unless the KL early stop fired
        n = sum(1 for t in train if t["grpo_step"] == r["grpo_step"])
        assert n == per_rollout if not r["train/kl_early_stop"] else 1 <= n < per_rollout
    assert [r["train_step"] for r in train] == list(range(len(train)))
    for key in ("train/loss", "train/grad_norm", "train/token_entropy", "train/clip_fraction", "train/lr",
                "train/kl_coef"):
        assert all(key in r for r in train)
    for key in ("train/reward", "train/format_reward", "train/answer_reward", "train/response_length",
                "health/zero_variance_group_fraction", "health/truncation_rate", "health/format_failure_rate",
                "health/wrong_answer_rate", "health/reward_errors", "health/logprob_mismatch_tokens",
                "time/rollout_s", "time/train_s", "time/tokens_per_s"):
        assert all(key in r for r in first), key
    # the mismatch is a figure only where something was measured (never a vacuous 0.0)
    assert all(("health/logprob_mismatch" in r) == (r["health/logprob_mismatch_tokens"] > 0) for r in first)
    assert all(r["health/logprob_mismatch"] < 1e-3 for r in first if "health/logprob_mismatch" in r)
    evals = [r for r in records if "eval_step" in r]
    assert [r["eval_step"] for r in evals] == [0, 1] and "eval/accuracy" in evals[0]
    assert all(math.isfinite(r["train/loss"]) for r in train)
    if cfg.kl_coef:
        assert all("train/kl" in r for r in train)
        # the coefficient moves by the controller's rule after each rollout batch, from the KL it measured
        coef = [r["train/kl_coef"] for r in first]
        assert coef[0] == 0.2
        for step in (1, 2):
            kls = [t["train/kl"] for t in train if t["grpo_step"] == step - 1]
            assert coef[step] == pytest.approx(_adaptive_kl_next(coef[step - 1], sum(kls) / len(kls), cfg), rel=1e-9)
        assert coef[1] != coef[0] and coef[2] != coef[1]
    else:
        assert all(r["train/kl_coef"] == 0.0 and "train/kl" not in r for r in train)
    assert (result.run_dir / "samples" / "eval_step_3.jsonl").exists()
    sample = json.loads((result.run_dir / "samples" / "eval_step_3.jsonl").read_text().splitlines()[0])
    assert {"prompt", "response", "ground_truth", "reward", "mean_token_entropy", "length"} <= set(sample)


def test_trainer_log_probs_equal_the_samplers_at_temperature(grpo_config):
    """On-policy at sampling_temperature 0.6: the trainer scores softmax(logits / 0.6), the
    distribution the sampler drew from, so the sampler/trainer mismatch is float noise."""
    cfg = grpo_config(n_grpo_steps=2, sampling_temperature=0.6, eval_examples=1, log_generations_samples=0,
                      reward="tests.helpers.reward_fixtures:length_parity")
    assert not cfg.off_policy
    result = train_grpo(cfg)
    mismatch = [r["health/logprob_mismatch"] for r in step_records(result)]
    assert len(mismatch) == 2 and all(m < 1e-5 for m in mismatch), mismatch


def test_mismatch_is_absent_when_nothing_was_measured_and_counted_when_it_was(grpo_config, tmp_path):
    """The random tiny model scores 0 on every arithmetic question: on-policy, no row trains and no
    trainer log-prob is known, so the step has no mismatch figure (it used to log a "perfect" 0.0);
    off-policy, the old log-probs of every sampled token are compared."""
    on = step_records(train_grpo(grpo_config(n_grpo_steps=1, eval_examples=1, log_generations_samples=0)))
    assert on[0]["train/rows_trained"] == 0
    assert "health/logprob_mismatch" not in on[0] and on[0]["health/logprob_mismatch_tokens"] == 0
    off = step_records(train_grpo(grpo_config(n_grpo_steps=1, eval_examples=1, log_generations_samples=0,
                                              train_batch_size=8, gradient_accumulation_steps=2,
                                              run_dir=str(tmp_path / "off"))))
    assert off[0]["health/logprob_mismatch_tokens"] > 0 and off[0]["health/logprob_mismatch"] < 1e-5


def test_advantage_eps_zero_with_zero_variance_groups_keeps_the_weights_finite(grpo_config, tiny_model, weights):
    cfg = grpo_config(n_grpo_steps=2, advantage_eps=0.0, skip_zero_advantage=False, eval_examples=1,
                      log_generations_samples=0, reward="tests.helpers.reward_fixtures:even_answer_or_length_parity")
    model, tok = tiny_model()
    before = weights(model)
    result = train_grpo(cfg, model=model, tokenizer=tok)
    steps = step_records(result)
    # some groups had zero variance (reward 1 throughout) and some did not
    assert any(0.0 < r["health/zero_variance_group_fraction"] < 1.0 for r in steps)
    assert all(r["health/nonfinite_steps"] == 0 for r in steps)  # no step was skipped as NaN ...
    assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in train_records(result))
    after = final_weights(result)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in after)  # ... and training moved the weights


def test_zero_variance_everywhere_gives_zero_update_and_a_diagnosis(grpo_config, tiny_model, weights, same_weights,
                                                                    capsys):
    cfg = grpo_config(n_grpo_steps=3, health_window=2, reward="tests.helpers.reward_fixtures:always_zero")
    model, tok = tiny_model()
    before = weights(model)
    result = train_grpo(cfg, model=model, tokenizer=tok)
    assert same_weights(before, model.state_dict())
    train = step_records(result)
    assert all(r["health/zero_variance_group_fraction"] == 1.0 for r in train)
    assert all(r["train/loss"] == 0.0 and r["train/grad_norm"] == 0.0 for r in train)
    err = capsys.readouterr()
    assert (err.out + err.err).count("No learning signal") == 1
    stop = cfg.model_copy(update={"stop_on_unhealthy": True, "run_dir": cfg.run_dir + "_stop"})
    with pytest.raises(UnhealthyRunError, match="No learning signal"):
        train_grpo(stop)


def _kl_stop_cfg(grpo_config, **kw):
    return grpo_config(n_grpo_steps=2, train_batch_size=8, learning_rate=1e-2, eval_examples=1,
                       log_generations_samples=0, reward="tests.helpers.reward_fixtures:length_parity", **kw)


def test_kl_early_stop_applies_only_the_first_optimizer_step_of_each_rollout_batch(grpo_config, tmp_path, same_weights,
                                                                                   monkeypatch):
    stopped = train_grpo(_kl_stop_cfg(grpo_config, kl_stop=1e-9, run_dir=str(tmp_path / "stopped")))
    train = train_records(stopped)
    assert [r["grpo_step"] for r in train] == [0, 1]  # one optimizer step per rollout batch
    assert all(r["train/kl_early_stop"] == 1 for r in step_records(stopped))
    assert all(r["train/approx_kl_old_new"] < 1e-9 for r in train)
    # the same run where each rollout batch has only its first optimizer batch, and no early stop:
    # equal weights. Had the stopped update been applied (or its gradient leaked into the next
    # step), the weights would differ.
    real = grpo_update.optimizer_batches
    monkeypatch.setattr(grpo_update, "optimizer_batches", lambda *a, **k: real(*a, **k)[:1])
    first_only = train_grpo(_kl_stop_cfg(grpo_config, kl_stop=None, run_dir=str(tmp_path / "first_only")))
    assert all(r["train/kl_early_stop"] == 0 for r in step_records(first_only))
    assert [r["grpo_step"] for r in train_records(first_only)] == [0, 1]
    assert same_weights(final_weights(stopped), final_weights(first_only))


def test_off_policy_epochs_reshuffle_with_a_generator_seeded_per_step(grpo_config, monkeypatch):
    calls = []
    real = grpo_update.optimizer_batches

    def spy(n_rows, batch_size, shuffle, generator=None, keep_together=None):
        seed = generator.initial_seed()
        batches = real(n_rows, batch_size, shuffle, generator, keep_together)
        calls.append(dict(seed=seed, generator=generator, shuffle=shuffle, batches=batches, keep=keep_together))
        return batches

    monkeypatch.setattr(grpo_update, "optimizer_batches", spy)
    cfg = grpo_config(n_grpo_steps=2, epochs_per_rollout_batch=2, train_batch_size=8, kl_stop=None, eval_examples=1,
                      log_generations_samples=0, reward="tests.helpers.reward_fixtures:length_parity")
    train_grpo(cfg)
    assert len(calls) == 4 and all(c["shuffle"] for c in calls)  # 2 steps x 2 epochs
    for step in (0, 1):
        e0, e1 = calls[2 * step], calls[2 * step + 1]
        assert e0["generator"] is e1["generator"]  # one generator per step, so epoch 1 continues its stream
        for c in (e0, e1):
            assert sorted(r for b in c["batches"] for r in b) == list(range(16))
            assert c["keep"] == [r // 4 for r in range(16)]  # rows kept with their prompt
        assert {frozenset(b) for b in e0["batches"]} != {frozenset(b) for b in e1["batches"]}
    assert calls[0]["seed"] != calls[2]["seed"]  # seeded per step ...
    assert calls[0]["batches"] != calls[2]["batches"]
    # ... and only by (seed, step): a resumed run reshuffles the same way
    g = torch.Generator().manual_seed(calls[2]["seed"])
    assert real(16, 8, True, g, calls[2]["keep"]) == calls[2]["batches"]


def test_kl_coef_zero_with_adaptive_kl_logs_a_zero_coefficient_and_no_kl(grpo_config):
    cfg = grpo_config(n_grpo_steps=2, kl_coef=0.0, kl_adaptive=True, kl_coef_min=0.1, eval_examples=1,
                      log_generations_samples=0, reward="tests.helpers.reward_fixtures:length_parity")
    train = train_records(train_grpo(cfg))
    assert len(train) == 2
    assert all(r["train/kl_coef"] == 0.0 for r in train)
    assert not any("train/kl" in r for r in train)


def _dropout_model():
    from transformers import LlamaForCausalLM

    from grpolab.models import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    config = build_tiny_model(tokenizer=tok).config
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    return LlamaForCausalLM(config), tok


def _two_train_forwards(model):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    model.train()
    with torch.no_grad():
        return model(ids).logits, model(ids).logits


def test_disable_dropout_turns_off_dropout_modules_and_attention_dropout():
    from grpolab.training.run_setup import disable_dropout

    model, _ = _dropout_model()
    a, b = _two_train_forwards(model)
    assert not torch.equal(a, b)  # the control: dropout is live in train mode
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    disable_dropout(model)
    disable_dropout(net)
    a, b = _two_train_forwards(model)
    assert torch.equal(a, b)
    assert net[1].p == 0.0
    assert all(m.attention_dropout == 0.0 for m in model.modules() if hasattr(m, "attention_dropout"))


@pytest.mark.parametrize("disable", [True, False])
def test_after_training_train_mode_is_deterministic_only_with_disable_dropout(grpo_config, disable):
    model, tok = _dropout_model()
    cfg = grpo_config(n_grpo_steps=1, disable_dropout=disable, eval_examples=1, log_generations_samples=0,
                      reward="tests.helpers.reward_fixtures:length_parity")
    steps = step_records(train_grpo(cfg, model=model, tokenizer=tok))
    a, b = _two_train_forwards(model)
    if disable:
        assert torch.equal(a, b)  # after Run-based training, train-mode forwards are deterministic
        assert steps[0]["health/logprob_mismatch"] < 1e-5  # so the trainer scores the sampler's distribution
    else:
        assert not torch.equal(a, b)
        assert steps[0]["health/logprob_mismatch"] > 1e-3


def test_grpo_on_a_local_jsonl_file_with_custom_fields(grpo_config, tmp_path):
    data = tmp_path / "questions.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"problem_text": f"{i}+1", "solution_value": i + 1}) + "\n")
        f.write("{broken\n")
    cfg = grpo_config(task=None, train_data=str(data), eval_data=str(data), data_format="jsonl",
                      question_field="problem_text", answer_field="solution_value", data_on_error="skip",
                      prompt_template="compact", reward="r1_zero_lenient", n_grpo_steps=1)
    with pytest.warns(UserWarning, match="skipped 1"):
        result = train_grpo(cfg)
    assert len(step_records(result)) == 1
    strict = cfg.model_copy(update={"data_on_error": "raise", "run_dir": str(tmp_path / "strict")})
    from grpolab.data import DataError

    with pytest.raises(DataError, match=r"questions.jsonl:17: invalid JSON"):
        train_grpo(strict)
    assert not (tmp_path / "strict").exists()  # refused before the run directory was touched
