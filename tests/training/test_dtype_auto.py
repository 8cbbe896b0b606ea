"""``dtype: auto`` (training/resources.choose_dtype, run_setup.resolve_auto_dtype): bf16 on a GPU, or
on a CPU with AMX / AVX-512 BF16 where a probe finds it faster; fp32 elsewhere. The decision is
tested with the machine's flags and timings passed in, so every branch runs on any CPU."""

import math

import pytest
import yaml

from grpolab.algorithms.grpo import GRPOConfig, train_grpo
from grpolab.training import resources
from grpolab.training.resources import BF16_MIN_PARAMS, choose_dtype

SMOLLM2 = (134_515_008, 576, 1536)  # parameters, hidden size, MLP width


def never(*args):
    raise AssertionError("probed")


@pytest.mark.parametrize("flags, timings, expected, said", [
    (set(), None, "float32", "no bf16 instructions"),  # an AVX2 CPU: not even probed
    ({"avx2", "avx512f"}, None, "float32", "no bf16 instructions"),  # AVX-512 without its BF16 extension
    ({"avx512f", "avx512_bf16"}, (0.010, 0.004), "bfloat16",
     "avx512_bf16; probe at 576x1536: fp32 10.0 ms, bf16 4.0 ms"),
    ({"amx_bf16", "avx512_bf16"}, (0.010, 0.003), "bfloat16", "amx_bf16"),
    ({"avx512_bf16"}, (0.010, 0.009), "float32", "bf16 does not pay here"),  # native, but not faster on this model
])
def test_the_cpu_decision_follows_the_flags_and_the_probe(flags, timings, expected, said):
    measure = never if timings is None else (lambda hidden, width: timings)
    dtype, line = choose_dtype("auto", "cpu", SMOLLM2, flags=flags, measure=measure)
    assert dtype == expected and said in line and line.startswith(f"dtype auto: {expected}")
    if expected == "bfloat16":
        assert "logits and log-softmax in fp32" in line


def test_small_models_given_dtypes_and_gpus():
    native = {"amx_bf16"}
    tiny = (900_000, 64, 256)
    assert choose_dtype("auto", "cpu", tiny, flags=native, measure=never) == \
        ("float32", "dtype auto: float32 (0.9M parameters: a step this small is bound by per-op overhead, not matmuls)")
    assert choose_dtype("auto", "cpu", (BF16_MIN_PARAMS, 576, 1536), flags=native, measure=lambda h, w: (1.0, 0.5))[0] \
        == "bfloat16"
    for given in ("float32", "bfloat16"):
        assert choose_dtype(given, "cpu", SMOLLM2, flags=native, measure=never) == (given, None)
    assert choose_dtype("auto", "cuda", tiny, cuda_bf16=lambda: True)[0] == "bfloat16"
    assert choose_dtype("auto", "cuda", SMOLLM2, cuda_bf16=lambda: False)[0] == "float32"
    # no probe (torchrun ranks must agree, deterministic runs): the flags alone
    assert choose_dtype("auto", "cpu", SMOLLM2, flags=native, measure=None)[0] == "bfloat16"
    assert choose_dtype("auto", "cpu", SMOLLM2, flags=set(), measure=None)[0] == "float32"


def test_the_real_probe_and_flags_on_this_machine():
    """The probe times both precisions on this CPU; without native bf16 it is never consulted."""
    fp32_s, bf16_s = resources._bf16_probe_seconds(64, 256, rows=32, repeats=1)
    assert math.isfinite(fp32_s) and math.isfinite(bf16_s)
    if not {"amx_bf16", "avx512_bf16"} & resources.cpu_flags():  # e.g. the developers' AVX2 EPYC
        assert choose_dtype("auto", "cpu", SMOLLM2, measure=never)[0] == "float32"


def config(tmp_path, **kw):
    fields = dict(model="embedded:tiny", task="arithmetic", run_dir=str(tmp_path / "run"), n_grpo_steps=1,
                  rollout_batch_size=4, group_size=2, train_batch_size=4, gradient_accumulation_steps=2,
                  sampling_max_tokens=8, eval_examples=2, show_progress=False, device="cpu", threads=1)
    return GRPOConfig(**{**fields, **kw})


def test_auto_is_the_default_and_a_run_records_what_it_chose(tmp_path, capfd):
    cfg = config(tmp_path)
    assert cfg.dtype == "auto"
    train_grpo(cfg)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["dtype"] == "float32"  # the tiny model is under BF16_MIN_PARAMS on every machine
    assert "grpolab: dtype auto: float32 (" in capfd.readouterr().err


def test_auto_choosing_bf16_turns_on_fp32_logits_and_a_resume_keeps_it(tmp_path, monkeypatch, capfd):
    from grpolab.models import logits_fp32_enabled
    from grpolab.training import run_setup

    seen = {}

    def as_if_amx(dtype, device, shape, **kw):
        seen["shape"] = shape
        return "bfloat16", "dtype auto: bfloat16 (as if on an AMX CPU)"

    def fp32_head(model):
        seen["model"] = original(model)
        return seen["model"]

    original = run_setup.set_logits_fp32
    monkeypatch.setattr(run_setup, "choose_dtype", as_if_amx)
    monkeypatch.setattr(run_setup, "set_logits_fp32", fp32_head)
    train_grpo(config(tmp_path, checkpoint_every=1))
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["dtype"] == "bfloat16" and saved["logits_fp32"] is True
    assert logits_fp32_enabled(seen["model"]) and seen["shape"][1] == seen["model"].config.hidden_size
    assert "dtype auto: bfloat16 (as if on an AMX CPU)" in capfd.readouterr().err
    # resumed with dtype auto: the saved choice, not a new probe
    monkeypatch.setattr(run_setup, "choose_dtype", never)
    train_grpo(config(tmp_path, n_grpo_steps=2), resume=True)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["dtype"] == "bfloat16"
