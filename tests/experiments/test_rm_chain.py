"""The learned-reward chain, short: preference pairs from the arithmetic task (a correct worked
solution vs the same with a wrong final answer) -> ``train_rm`` -> the RM ranks held-out test pairs
above chance -> a GRPO step runs on its reward alone (``grpolab.experiments.rm_chain`` is the measured version)."""

from __future__ import annotations

import math

from grpolab.algorithms.grpo import train_grpo
from grpolab.algorithms.rm import RMConfig, pairwise_accuracy, train_rm
from grpolab.data import get_task
from grpolab.experiments.rm_chain import rm_reward
from grpolab.models.classifier import load_sequence_classifier
from grpolab.training.inputs import prompt_template_for, task_preference_pairs
from grpolab.training.metric_logging import read_metrics

OPTIONS = {"digits": 1, "num_ops": 2, "ops": "+-"}
N_TEST = 100


def test_a_reward_model_trained_on_task_pairs_ranks_held_out_pairs_and_drives_grpo(tmp_path, grpo_config):
    cfg = RMConfig(model="embedded:tiny", task="arithmetic", task_options=OPTIONS, n_rm_steps=100, train_batch_size=16,
                   learning_rate=3e-3, task_train_size=400, eval_pairs=32, device="cpu", show_progress=False,
                   run_dir=str(tmp_path / "rm"))
    rm = train_rm(cfg)
    task = get_task("arithmetic", **OPTIONS)
    pairs = task_preference_pairs("arithmetic", "test", N_TEST, 0, OPTIONS, prompt_template_for(task, None))
    model, tok = load_sequence_classifier(str(rm.final_dir))
    accuracy = pairwise_accuracy(model.eval(), tok, pairs, cfg, "cpu")["pairwise_accuracy"]
    # above chance: P(>= 65 of 100 right | a coin) < 0.2 %
    assert accuracy >= 0.65, accuracy
    assert sum(math.comb(N_TEST, k) for k in range(65, N_TEST + 1)) / 2**N_TEST < 0.002

    grpo = train_grpo(grpo_config(task_options=OPTIONS, reward=rm_reward(rm.final_dir), n_grpo_steps=1))
    row = next(r for r in read_metrics(grpo.metrics_path) if "train/reward" in r)
    assert row["health/reward_errors"] == 0 and row["train/reward_std"] > 0  # the RM's scores vary: a gradient
    assert "train/reward_rm_raw" in row and "train/reward_verifier" in row  # both logged; only the RM is trained on
