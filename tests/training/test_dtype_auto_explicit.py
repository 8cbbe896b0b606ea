"""Start-up settings taken as given (reliability probe, turn 5): ``dtype: auto`` keeps an explicit
``logits_fp32: false`` (T03: when auto chose bfloat16 it turned the fp32 head on and the run's config
recorded ``logits_fp32: true`` without a word); a ``sampler_threads`` nothing uses is said (A06).
Only the machine's answer is set here (bf16, as on an AMX CPU); the rest is real."""

from __future__ import annotations

import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.models import load_model_and_tokenizer
from grpolab.training import run_setup
from grpolab.training.config import CommandLineValue


def _bf16_here(dtype, device, shape, **kw):
    return "bfloat16", "dtype auto: bfloat16 (as if on an AMX CPU; logits and log-softmax in fp32)"


def test_T03_an_explicit_logits_fp32_false_is_kept_and_said(monkeypatch, capfd):
    monkeypatch.setattr(run_setup, "choose_dtype", _bf16_here)
    model, _ = load_model_and_tokenizer("embedded:tiny", seed=0)
    given = GRPOConfig.build(None, {"dtype": "auto", "logits_fp32": CommandLineValue("false")})
    run_setup.resolve_auto_dtype(given, model, torch.device("cpu"), probe=False)
    assert given.dtype == "bfloat16" and given.logits_fp32 is False
    assert "logits_fp32 false as given" in capfd.readouterr().err
    default = GRPOConfig.build(None, {"dtype": "auto"})  # not given: auto's bf16 brings the fp32 head
    run_setup.resolve_auto_dtype(default, model, torch.device("cpu"), probe=False)
    assert default.dtype == "bfloat16" and default.logits_fp32 is True


def test_A06_a_sampler_threads_no_sampler_uses_is_said(capfd):
    """``sampler_threads`` without ``max_staleness`` was accepted and ignored without a word."""
    for overrides, said in (({"sampler_threads": 4}, True), ({"sampler_threads": 4, "max_staleness": 1}, False),
                            ({}, False)):
        cfg = GRPOConfig(n_grpo_steps=3, **overrides)
        run_setup.set_cpu_threads(cfg, torch.device("meta"), probe=False)
        assert ("sampler_threads 4 is not used" in capfd.readouterr().err) is said, overrides
