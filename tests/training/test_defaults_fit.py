"""Defaults that fit each other (issue 59): a bare GRPO config runs on the default model; a misspelt key
gets a spelling hint, a bare name a list field."""

import pytest
import yaml

from grpolab.algorithms.grpo import GRPOConfig, train_grpo
from grpolab.data import DataError
from grpolab.training.config import CommandLineValue, ConfigError

SMALL = dict(n_grpo_steps=1, rollout_batch_size=4, group_size=2, train_batch_size=4, gradient_accumulation_steps=2,
             eval_examples=2, show_progress=False, device="cpu", threads=1)


def test_the_default_max_tokens_is_lowered_to_the_default_models_context(tmp_path, capsys):
    cfg = GRPOConfig(run_dir=str(tmp_path / "run"), **SMALL)  # model embedded:tiny (512 tokens), max tokens 1024
    assert cfg.model == "embedded:tiny" and cfg.sampling_max_tokens == 1024
    train_grpo(cfg)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert 400 < saved["sampling_max_tokens"] < 512
    assert "sampling_max_tokens 1024 (the default) does not fit" in capsys.readouterr().err
    cfg = GRPOConfig(run_dir=str(tmp_path / "set"), sampling_max_tokens=1024, **SMALL)  # set: kept and checked
    with pytest.raises(DataError, match="sampling_max_tokens 1024 it exceeds the model's context of 512"):
        train_grpo(cfg)


def test_a_misspelt_key_gets_the_closest_field(tmp_path):
    with pytest.raises(ConfigError) as cli:
        GRPOConfig.build(None, {"group_sise": CommandLineValue("4")})
    assert str(cli.value) == "unknown key 'group_sise' (command line); did you mean 'group_size'?"
    path = tmp_path / "c.yaml"
    path.write_text("lerning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'lerning_rate'; did you mean 'learning_rate'\?$"):
        GRPOConfig.build(path)
    with pytest.raises(ConfigError) as far:
        GRPOConfig.build(None, {"zzzz": CommandLineValue("1")})
    assert "valid keys" not in str(far.value) and "grpolab config grpo" in str(far.value)


def test_a_bare_name_is_a_list_of_one_for_a_list_field(tmp_path):
    assert GRPOConfig.build(None, {"report_to": CommandLineValue("wandb")}).report_to == ["wandb"]
    path = tmp_path / "c.yaml"
    path.write_text("report_to: tensorboard\n")
    assert GRPOConfig.build(path).report_to == ["tensorboard"]
    assert GRPOConfig(lora_target_modules="all-linear").lora_target_modules == "all-linear"  # str allowed: kept
