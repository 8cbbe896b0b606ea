"""What a reward model must be, checked in one line each: a sequence classifier (a causal LM is refused when
the config is built; ``grpolab rm`` still starts from one), weights that read whole, a trained head, a device
this machine has, a tokenizer with the chat template it is asked to use; a model loaded once, by the
trainers' input check, is the one that scores."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.models.classifier import load_sequence_classifier
from grpolab.models.loading import ModelLoadError
from grpolab.rewards import RewardScorer, build_reward, check_reward_spec
from grpolab.rewards.reward_model import load_reward_models
from grpolab.training.config import ConfigError
from tests.rewards.model_dirs import causal_lm_dir, headless_classifier_dir, reward_model_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_checks")
    return {"rm": reward_model_dir(root / "rm"), "lm": causal_lm_dir(root / "lm"), "root": root}


def one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def test_a_causal_lm_is_refused_as_a_reward_model_when_the_config_is_built(dirs):
    lm = str(dirs["lm"])
    with pytest.raises(ValueError) as err:
        check_reward_spec({"model": lm})
    text = one_line(err)
    assert text.startswith(f"reward.model: {lm}: a LlamaForCausalLM (a causal LM, no sequence-classification head)")
    assert "AutoModelForSequenceClassification" in text and "grpolab rm" in text
    with pytest.raises(ConfigError) as err:  # in the list too, naming the component
        GRPOConfig.build(None, {"reward": [{"fn": "arithmetic"}, {"model": lm}]})
    assert "reward[1].model" in one_line(err)


def test_grpolab_rms_starting_point_still_gives_a_causal_lm_a_fresh_head(dirs):
    model, _ = load_sequence_classifier(str(dirs["lm"]))
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1


def test_a_device_torch_can_read_but_this_machine_lacks_names_reward_device(dirs):
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    reward = build_reward({"model": str(dirs["rm"]), "device": device})
    with pytest.raises(ValueError) as err:
        load_reward_models(reward)
    assert one_line(err).startswith(f"reward.device '{device}': this ")


@pytest.mark.parametrize("device", ["gpu0", "meta"])  # meta: a device torch reads, where no score is computed
def test_a_device_no_reward_model_runs_on_is_refused_in_one_line(dirs, device):
    with pytest.raises(ValueError) as err:
        check_reward_spec({"model": str(dirs["rm"]), "device": device})
    assert one_line(err).startswith(f"reward.device: '{device}' is not a device a reward model runs on (cpu, cuda")


def test_truncated_weights_are_one_line_naming_the_file(dirs):
    damaged = dirs["root"] / "truncated"
    shutil.copytree(dirs["rm"], damaged)
    os.truncate(damaged / "model.safetensors", 100_000)
    with pytest.raises(ModelLoadError) as err:
        load_sequence_classifier(str(damaged))
    assert one_line(err).startswith(f"{damaged / 'model.safetensors'}: damaged or truncated weights file")


def test_a_classifier_without_its_head_weights_is_refused_as_a_reward_model(dirs):
    path = headless_classifier_dir(dirs["root"] / "headless")
    reward = build_reward({"model": str(path)})  # config.json says a sequence classifier
    with pytest.raises(ModelLoadError) as err:
        load_reward_models(reward)
    assert "lack score.weight" in one_line(err) and "random" in one_line(err)


def test_a_directory_that_is_not_a_model_gets_the_model_loaders_line(tmp_path):
    with pytest.raises(ModelLoadError) as err:  # grpolab rm --model DIR: not the tokenizer's complaint
        load_sequence_classifier(str(tmp_path))
    assert one_line(err) == f"no config.json in {tmp_path}: not a Hugging Face model directory"


def test_label_and_chat_template_are_checked_when_the_model_loads(dirs):
    with pytest.raises(ValueError, match="label 5 out of range"):
        load_reward_models(build_reward({"model": str(dirs["rm"]), "label": 5}))
    with pytest.raises(ValueError, match="chat_template is set but its tokenizer has no chat template"):
        load_reward_models(build_reward({"model": str(dirs["rm"]), "chat_template": True}))


def test_the_model_loaded_by_the_check_is_the_one_that_scores(dirs, monkeypatch):
    import grpolab.models.classifier as classifier

    calls = []
    real = classifier.load_sequence_classifier
    monkeypatch.setattr(classifier, "load_sequence_classifier", lambda *a, **k: calls.append(a) or real(*a, **k))
    reward = build_reward({"model": str(dirs["rm"])})
    load_reward_models(reward, None, device=torch.device("cpu"))
    with RewardScorer(reward, device=torch.device("cpu")) as scorer:
        scorer.score(["2"], [None], prompts=["Q: 1+1="])
    assert len(calls) == 1
