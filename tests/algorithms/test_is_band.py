"""The length-invariant sequence weight and IcePop's token band as GRPO fields: the band turns the
sampler/trainer correction on, refuses ``none``, and reaches the update (its figure is logged)."""

import warnings

import pytest
from pydantic import ValidationError

from grpolab.algorithms.grpo import GRPOConfig, train_grpo
from grpolab.training.metric_logging import read_metrics


def test_the_band_turns_the_correction_on_and_needs_one():
    assert GRPOConfig().is_band is None and GRPOConfig().is_correction == "none"
    cfg = GRPOConfig(importance_sampling_mask_low=0.5, importance_sampling_mask_high=2.0)
    assert cfg.is_band == (0.5, 2.0) and cfg.is_correction == "tis"
    assert GRPOConfig(importance_sampling_mask_high=2.0, importance_sampling_correction="mis").is_correction == "mis"
    with pytest.raises(ValidationError, match="need importance_sampling_correction tis or mis"):
        GRPOConfig(importance_sampling_mask_low=0.5, importance_sampling_correction="none")
    with pytest.raises(ValidationError, match="importance_sampling_mask_low"):
        GRPOConfig(importance_sampling_mask_low=1.5)
    assert GRPOConfig(importance_sampling_level="sequence_product").importance_sampling_level == "sequence_product"


def test_a_run_with_the_band_and_the_geometric_sequence_level_logs_the_masked_share(tmp_path):
    cfg = GRPOConfig(rollout_batch_size=8, group_size=4, train_batch_size=8, gradient_accumulation_steps=1,
                     sampling_max_tokens=6, sampling_min_tokens=1, device="cpu", show_progress=False,
                     task_train_size=20, n_grpo_steps=1, eval_examples=2, run_dir=str(tmp_path / "run"),
                     importance_sampling_level="sequence", importance_sampling_mask_low=0.5,
                     importance_sampling_mask_high=2.0, skip_zero_advantage=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train_grpo(cfg)
    train = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    # the hf sampler is the trainer: every ratio is 1 up to float error, inside the band
    assert train and all(r["train/is_band_masked_fraction"] == 0.0 for r in train)
    assert all(abs(r["train/is_ratio_mean"] - 1) < 1e-4 for r in train)
