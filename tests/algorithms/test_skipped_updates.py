"""No update is skipped silently (issue 55): the KL early stop is off for GRPO unless set (CS336 has
none), and every skipped optimizer step -- KL early stop or non-finite loss -- prints one line and is
counted in metrics.jsonl as ``train/skipped_updates`` with its reason."""

import torch

from grpolab.algorithms.distill import DistillConfig
from grpolab.algorithms.dpo import DPOConfig, train_dpo
from grpolab.algorithms.grpo import GRPOConfig, train_grpo
from grpolab.algorithms.ppo import PPOConfig, train_ppo
from grpolab.training.metric_logging import read_metrics


def test_kl_stop_is_off_for_grpo_and_distill_and_kept_for_ppo():
    assert GRPOConfig().kl_stop is None and DistillConfig().kl_stop is None
    assert PPOConfig().kl_stop == 0.3


def _off_policy(grpo_config, tmp_path, name, **kw):
    # 16 rollouts in optimizer batches of 8: two optimizer steps per rollout batch, the second off-policy
    return grpo_config(n_grpo_steps=2, train_batch_size=8, learning_rate=1e-2, eval_examples=1,
                       log_generations_samples=0, reward="tests.helpers.reward_fixtures:length_parity",
                       run_dir=str(tmp_path / name), **kw)


def test_grpo_off_policy_by_default_takes_every_update(grpo_config, tmp_path):
    result = train_grpo(_off_policy(grpo_config, tmp_path, "default"))
    records = [r for r in read_metrics(result.metrics_path) if "train_step" in r]
    assert [r["grpo_step"] for r in records] == [0, 0, 1, 1]
    assert sum(r["train/skipped_updates"] for r in records) == 0


def test_grpo_kl_early_stop_is_said_and_counted(grpo_config, tmp_path, capsys):
    result = train_grpo(_off_policy(grpo_config, tmp_path, "stopped", kl_stop=1e-9))
    captured = capsys.readouterr()
    err = captured.out + captured.err  # health lines go through the progress bar's writer (stdout)
    assert err.count("KL early stop") == 2 and "1 of 2 optimizer updates of this rollout batch skipped" in err
    records = [r for r in read_metrics(result.metrics_path) if "train_step" in r]
    assert [r["grpo_step"] for r in records] == [0, 1]
    assert [(r["train/skipped_updates"], r["train/skipped_updates_kl_stop"]) for r in records] == [(1, 1), (1, 1)]


def test_ppo_kl_early_stop_is_said_and_counted(tmp_path, capsys):
    cfg = PPOConfig(n_ppo_steps=1, rollout_batch_size=8, group_size=2, train_batch_size=4, ppo_epochs=2, kl_stop=1e-9,
                    reward="tests.helpers.reward_fixtures:length_parity",  # rewards that vary: the weights move
                    sampling_max_tokens=6, sampling_min_tokens=1, learning_rate=1e-2, eval_examples=1,
                    log_generations_samples=0, task_train_size=50, run_dir=str(tmp_path / "ppo"),
                    show_progress=False, device="cpu")
    result = train_ppo(cfg)
    captured = capsys.readouterr()
    assert "3 of 4 optimizer updates of this rollout batch skipped" in captured.out + captured.err
    records = read_metrics(result.metrics_path)
    assert sum(r.get("train/skipped_updates", 0) for r in records) == 3
    assert [r["train/skipped_updates_kl_stop"] for r in records if "train/reward" in r] == [3]


def test_a_non_finite_update_is_counted_per_step(tmp_path):
    from grpolab.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.convert_tokens_to_ids("<think>")] = float("nan")  # in every prompt
    result = train_dpo(DPOConfig(n_dpo_steps=2, train_batch_size=4, task_train_size=8, eval_pairs=4, learning_rate=1e-3,
                                 run_dir=str(tmp_path / "dpo"), show_progress=False, device="cpu"),
                       model=model, tokenizer=tok)
    steps = [r for r in read_metrics(result.metrics_path) if "train_step" in r]
    assert [(r["train/skipped_updates"], r["train/skipped_updates_nonfinite"]) for r in steps] == [(1, 1), (1, 1)]


def test_an_expert_iteration_step_that_keeps_too_few_is_said_and_counted(tmp_path, small_run, capsys):
    from grpolab.algorithms.expert_iteration import EIConfig, train_expert_iteration

    cfg = EIConfig(n_ei_steps=2, ei_batch_size=4, group_size=2, train_batch_size=4, gradient_accumulation_steps=2,
                   reward="tests.helpers.reward_fixtures:always_zero", run_dir=str(tmp_path / "ei"), **small_run)
    result = train_expert_iteration(cfg)
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count("correct response(s) kept, fewer than the 2 one SFT step needs") == 2
    steps = [r for r in read_metrics(result.metrics_path) if "ei/filtered_size" in r]
    assert [(r["ei/filtered_size"], r["train/skipped_updates"], r["train/skipped_updates_too_few_kept"])
            for r in steps] == [(0, 1, 1), (0, 1, 1)]
