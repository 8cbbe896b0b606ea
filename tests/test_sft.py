"""SFT trainer: the loss falls, filtering, data sources, resume."""

import json

import pytest
import torch

from grpolab.algorithms.config import ConfigError
from grpolab.algorithms.sft import SFTConfig, train_sft
from grpolab.algorithms.metrics import read_metrics


def cfg(tmp_path, **kw):
    base = dict(n_sft_steps=30, learning_rate=3e-3, train_batch_size=16, gradient_accumulation_steps=2, warmup_steps=0,
                eval_examples=8, sampling_max_tokens=24, run_dir=str(tmp_path / "sft"), show_progress=False,
                task_train_size=64, device="cpu")
    base.update(kw)
    return SFTConfig(**base)


def test_sft_loss_falls_and_writes_run(tmp_path):
    result = train_sft(cfg(tmp_path))
    nll = [r["train/token_nll"] for r in read_metrics(result.metrics_path) if "train/token_nll" in r]
    assert len(nll) == 30 and sum(nll[-5:]) / 5 < 0.6 * sum(nll[:3]) / 3
    assert (result.final_dir / "model.safetensors").exists()
    assert "accuracy" in result.after


def test_filter_correct_and_max_examples(tmp_path):
    opts = {"wrong_fraction": 0.5}
    all_pairs = train_sft(cfg(tmp_path, n_sft_steps=1, task_options=opts, run_dir=str(tmp_path / "a")))
    kept = train_sft(cfg(tmp_path, n_sft_steps=1, task_options=opts, filter_correct=True, run_dir=str(tmp_path / "b")))
    assert all_pairs.n_examples == 64 and 15 < kept.n_examples < 50
    capped = train_sft(cfg(tmp_path, n_sft_steps=1, max_examples=10, run_dir=str(tmp_path / "c")))
    assert capped.n_examples == 10


def test_sft_on_cs336_style_jsonl(tmp_path):
    data = tmp_path / "sft.jsonl"
    with open(data, "w") as f:
        for i in range(20):
            f.write(json.dumps({"prompt": f"Q: {i}+1\nA: <think>", "response": f"{i}+1={i + 1}</think> <answer>{i + 1}</answer>",
                                "ground_truth": str(i + 1)}) + "\n")
    result = train_sft(cfg(tmp_path, task=None, train_data=str(data), n_sft_steps=3, reward="arithmetic",
                           filter_correct=True))
    assert result.n_examples == 20


def test_sft_config_errors():
    with pytest.raises(ConfigError, match="train_batch_size"):
        SFTConfig.build(None, {"train_batch_size": 10, "gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match="exactly one of task"):
        SFTConfig.build(None, {"train_data": "x.jsonl"})


def test_sft_resume_matches_uninterrupted(tmp_path):
    from safetensors.torch import load_file

    full = train_sft(cfg(tmp_path, n_sft_steps=6, checkpoint_every=3, run_dir=str(tmp_path / "full"), eval_examples=2,
                         lr_schedule="constant"))
    part = cfg(tmp_path, n_sft_steps=3, checkpoint_every=3, run_dir=str(tmp_path / "part"), eval_examples=2,
               lr_schedule="constant")
    train_sft(part)
    resumed = train_sft(part.model_copy(update={"n_sft_steps": 6}), resume=True)
    a = load_file(full.final_dir / "model.safetensors")
    b = load_file(resumed.final_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
