"""The memory planner's arithmetic against the real objects it describes (fast; the comparison with
measured peak memory is tests/scale/test_memory_plan.py), and ``grpolab plan``'s one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.training.memory_plan import estimate
from grpolab.training.plan_inputs import ARCHITECTURES, GiB, Hardware, ModelShape, model_shape

ROOT = Path(__file__).resolve().parents[2]


def test_parameter_counts_equal_the_models_own(tiny_model):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model, _ = tiny_model()
    assert model_shape("embedded:tiny")[0].n_params == sum(p.numel() for p in model.parameters())
    # a Qwen2 (q/k/v biases, untied head, GQA) built from a preset's shape scaled down
    small = dict(ARCHITECTURES["Qwen2.5-Math-7B"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    qwen = Qwen2ForCausalLM(Qwen2Config(**small))
    assert ModelShape.from_config(small, "test").n_params == sum(p.numel() for p in qwen.parameters())


def test_the_hf_samplers_weight_terms_equal_the_fast_decoders_own_tensors():
    """The fused q/k/v and gate/up copies (fp32), and under bf16 autocast the bf16 copies of every
    matmul weight the decoder holds through a rollout, byte for byte."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpolab.rollout.fast_decoder import FastDecoder

    small = dict(ARCHITECTURES["Qwen2.5-Math-7B"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    dec = FastDecoder(Qwen2ForCausalLM(Qwen2Config(**small)))
    shape = ModelShape.from_config(small, "test")

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    assert shape.fused_sampler_bytes() == nbytes(t for lay in dec.layers for t in (lay.qkv_w, lay.qkv_b, lay.gate_up_w))
    layers, head = dec._weights(torch.bfloat16)
    cast = [head] + [getattr(lay, n) for lay in layers for n in ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "down_w")]
    assert all(t is None or t.dtype == torch.bfloat16 for t in cast)
    assert shape.cast_sampler_bytes() == nbytes(cast)
    # logits_fp32: the head runs its fp32 copy, so none is cast to bf16
    from grpolab.models.precision import set_logits_fp32

    set_logits_fp32(dec.model)
    dec.refresh()
    layers, head = dec._weights(torch.bfloat16)
    assert head.dtype == torch.float32
    cast = [getattr(lay, n) for lay in layers for n in ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "down_w")]
    assert shape.cast_sampler_bytes(head=False) == nbytes(cast)


def test_a_bf16_hf_rollout_plans_the_bf16_weight_copies_in_the_rollout_alone(tmp_path):
    base = dict(model="embedded:small", run_dir=str(tmp_path), rollout_batch_size=16, group_size=4, train_batch_size=16,
                gradient_accumulation_steps=2)
    plans = {d: estimate(GRPOConfig.build(None, dict(base, dtype=d)), Hardware("cpu", 1, 8 * GiB), prompt_tokens=16)
             for d in ("float32", "bfloat16")}
    term = "sampler's bf16 weights (hf)"
    cast = model_shape("embedded:small")[0].cast_sampler_bytes()
    assert plans["float32"].terms[term] == 0 and plans["bfloat16"].terms[term] == cast
    fp32, bf16 = plans["float32"].phases, plans["bfloat16"].phases
    kv = plans["float32"].terms["KV cache"] - plans["bfloat16"].terms["KV cache"]
    assert bf16["rollout"] - fp32["rollout"] == cast - kv
    assert bf16["optimizer step"] == fp32["optimizer step"]
    fp32_head = estimate(GRPOConfig.build(None, dict(base, dtype="bfloat16", logits_fp32=True)),
                         Hardware("cpu", 1, 8 * GiB), prompt_tokens=16)
    assert fp32_head.terms[term] == model_shape("embedded:small")[0].cast_sampler_bytes(head=False) < cast


def test_a_bf16_lora_run_on_the_cpu_plans_its_fp32_checkpoint_still_mapped(tmp_path):
    # the frozen fp32 tensors left after the adapted layers' base is cast to bf16 view the safetensors mmap, so
    # those layers' pages stay resident (measured by tests/scale/test_memory_plan.py's single-lora-bf16 row)
    small = dict(ARCHITECTURES["Qwen2.5-Math-7B"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    term = "checkpoint mmap (CPU)"

    def plan(file_dtype, kind="cpu", dtype="bfloat16", lora_r=8, model=None):
        if model is None:
            model = tmp_path / file_dtype
            model.mkdir(exist_ok=True)
            (model / "config.json").write_text(json.dumps(dict(small, dtype=file_dtype)))
        cfg = GRPOConfig.build(None, dict(model=str(model), run_dir=str(tmp_path / "run"), dtype=dtype, lora_r=lora_r,
                                          rollout_batch_size=16, group_size=4, train_batch_size=16,
                                          gradient_accumulation_steps=2))
        return estimate(cfg, Hardware(kind, 1, 8 * GiB), prompt_tokens=16)

    shape = ModelShape.from_config(small, "test")
    adapted = round(shape.n_params * shape.lora_weight_fraction("all-linear"))
    mapped = plan("float32")
    assert abs(mapped.terms[term] - 4 * adapted) <= 4
    assert mapped.phases["optimizer step"] - plan("float32", kind="gpu").phases["optimizer step"] == mapped.terms[term]
    for other in (plan("float32", kind="gpu"), plan("bfloat16"), plan("float32", dtype="float32"),
                  plan("float32", lora_r=0), plan("", model="embedded:small")):
        assert term not in other.terms


def test_known_architectures_have_their_published_sizes():
    assert round(model_shape("x", "Qwen2.5-Math-1.5B")[0].n_params / 1e9, 2) == 1.54
    assert round(model_shape("x", "Qwen2.5-Math-7B")[0].n_params / 1e9, 2) == 7.62


def test_lora_parameter_count_equals_peft(tiny_model):
    from grpolab.models import lora

    model = lora.apply_lora(tiny_model()[0], 8, 16.0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_shape("embedded:tiny")[0].lora_params(8, "all-linear") == trainable


def test_sharding_divides_the_optimizer_state_and_ddp_does_not(tmp_path):
    base = dict(model="embedded:small", run_dir=str(tmp_path), rollout_batch_size=16, group_size=4, train_batch_size=16,
                gradient_accumulation_steps=2)
    terms = {s: estimate(GRPOConfig.build(None, dict(base, distributed=s)), Hardware("cpu", 4, 8 * GiB),
                         prompt_tokens=16).terms for s in ("ddp", "fsdp2")}
    assert terms["fsdp2"]["optimizer states (AdamW)"] * 4 == terms["ddp"]["optimizer states (AdamW)"]
    assert terms["fsdp2"]["weights"] * 4 == terms["ddp"]["weights"]


def test_a_smaller_gpu_does_not_fit_and_the_micro_batch_limit_shrinks(tmp_path):
    cfg = GRPOConfig.build(ROOT / "configs" / "grpo_qwen2.5_math_1.5b_gsm8k.yaml", {"run_dir": str(tmp_path)})
    big, small = (estimate(cfg, Hardware("gpu", 1, g * GiB)) for g in (80, 24))
    assert big.fits and not small.fits
    assert big.max_micro_batch["without checkpointing"] > small.max_micro_batch["without checkpointing"]


def test_model_config_json_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(ARCHITECTURES["Qwen2.5-Math-1.5B"], num_hidden_layers=2)))
    shape, source = model_shape(str(tmp_path))
    assert shape.num_hidden_layers == 2 and source.endswith("config.json")


@pytest.mark.parametrize("args,says", [
    (["--config", "configs/grpo_tiny.yaml", "--model", "/nowhere/MyModel"], "model: /nowhere/MyModel"),
    (["--config", "configs/grpo_tiny.yaml", "--gpus", "2"], "--gpu-memory"),
    (["--config", "configs/grpo_tiny.yaml", "--architecture", "gpt-9"], "--architecture"),
    (["--config", "configs/nope.yaml"], "configs/nope.yaml"),
])
def test_plan_errors_are_one_line_naming_the_input(args, says, monkeypatch):
    from typer.testing import CliRunner

    from grpolab import cli

    monkeypatch.chdir(ROOT)
    out = CliRunner().invoke(cli.app, ["plan", *args])
    assert out.exit_code == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_plan_command_prints_every_term_and_the_verdict(monkeypatch):
    from typer.testing import CliRunner

    from grpolab import cli

    monkeypatch.chdir(ROOT)
    out = CliRunner().invoke(cli.app, ["plan", "--config", "configs/grpo_qwen2.5_math_1.5b_gsm8k.yaml", "--gpus", "1",
                                       "--gpu-memory", "80"])
    assert out.exit_code == 0, out.output
    for term in ("weights", "gradients", "optimizer states", "activations", "log-prob buffers", "vLLM weights",
                 "KV cache", "reference model", "largest micro-batch", "fits"):
        assert term in out.stdout, term


def _zero_terms(tmp_path, stage: int, **zero) -> tuple[dict, int]:
    path = tmp_path / f"zero{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage, **zero}}))
    cfg = GRPOConfig(model="/absent/Qwen2.5-Math-1.5B", distributed="deepspeed", deepspeed_config=str(path),
                     rollout_batch_size=64, group_size=8, train_batch_size=64, gradient_accumulation_steps=8,
                     dtype="bfloat16", run_dir=str(tmp_path / "run"))
    plan = estimate(cfg, Hardware("gpu", 8, 80 * GiB), prompt_tokens=256)
    return plan.terms, plan.shape.n_params


def test_zero_1_and_2_keep_deepspeeds_fp32_master_partition_and_shard_adamw(tmp_path):
    # DeepSpeed's stage_1_and_2.py: every rank keeps an fp32 clone of its partition
    # (single_partition_of_fp32_groups) beside the whole weights, and AdamW's states of it only;
    # ZeRO-2 keeps its partition of the gradients, ZeRO-1 every gradient and a copy of its partition
    world = 8
    for stage in (1, 2):
        terms, P = _zero_terms(tmp_path, stage)
        assert terms["weights"] == 4 * P + 4 * P // world, stage
        assert terms["optimizer states (AdamW)"] == 8 * P // world, stage
        assert terms["gradients"] == (4 * P if stage == 1 else 0) + 4 * P // world, stage
        assert terms["ZeRO gradient bucket"] == 4 * 5 * 10**8, stage  # contiguous_gradients: a 5e8-element bucket
    assert _zero_terms(tmp_path, 2, overlap_comm=True)[0]["ZeRO gradient bucket"] == 2 * 4 * 5 * 10**8
    assert _zero_terms(tmp_path, 2, contiguous_gradients=False)[0]["ZeRO gradient bucket"] == 0
    terms, P = _zero_terms(tmp_path, 3)  # ZeRO-3 as before: the parameters' partition and the master's
    assert terms["weights"] == 4 * P // world + 4 * P // world and terms["gradients"] == 4 * P // world


def test_an_unknown_zero_stage_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"zero_optimization.stage must be 0, 1, 2 or 3, got 'two'"):
        _zero_terms(tmp_path, "two")
