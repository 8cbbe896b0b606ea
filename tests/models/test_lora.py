"""LoRA via peft: the reference policy is the base (adapter disabled, no copy), the sampler's merged
weights compute the same policy, and a LoRA GRPO run saves its adapter and a merged model."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[scale]')")

from grpolab.models import load_model_and_tokenizer  # noqa: E402
from grpolab.models.fused_head import response_log_probs  # noqa: E402
from grpolab.models.lora import AdapterDisabled, apply_lora, lora_scaling, merged_state_dict  # noqa: E402


def _trained_lora():
    base, _ = load_model_and_tokenizer("embedded:tiny", seed=0)
    plain, _ = load_model_and_tokenizer("embedded:tiny", seed=0)
    model = apply_lora(base, r=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter: B != 0, so the adapted policy differs from the base
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model, plain


def test_reference_log_probs_equal_the_base_models_and_merged_weights_equal_the_adapted_policy():
    model, plain = _trained_lora()
    ids = torch.randint(5, 40, (3, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    with torch.no_grad():
        base_lp = response_log_probs(plain, ids, labels)["log_probs"]
        ref_lp = response_log_probs(AdapterDisabled(model), ids, labels)["log_probs"]
        adapted = response_log_probs(model, ids, labels)["log_probs"]
        plain.load_state_dict(merged_state_dict(model.state_dict(), lora_scaling(model)))
        merged = response_log_probs(plain, ids, labels)["log_probs"]
    assert torch.equal(ref_lp, base_lp)  # the base itself, bit for bit
    assert (adapted - base_lp).abs().max() > 1e-3  # the adapter does change the policy
    assert torch.allclose(merged, adapted, atol=1e-5)
    assert AdapterDisabled(model).state_dict() == {}  # nothing copied, nothing checkpointed twice


def test_lora_grpo_run_saves_adapter_and_merged_model(tmp_path, small_run):
    from transformers import AutoModelForCausalLM

    from grpolab.algorithms.grpo import GRPOConfig, train_grpo

    cfg = GRPOConfig(**small_run, n_grpo_steps=2, rollout_batch_size=8, group_size=4, train_batch_size=8,
                     gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=0, kl_coef=0.1,
                     entropy_coef=0.5,  # a gradient even when every reward is 0 (the random tiny model)
                     lora_r=4, lora_alpha=8, lora_save_merged=True, gradient_checkpointing=True,
                     run_dir=str(tmp_path / "run"), checkpoint_every=1)
    result = train_grpo(cfg)
    adapter = json.loads((result.final_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4
    merged = AutoModelForCausalLM.from_pretrained(str(result.final_dir))
    base, _ = load_model_and_tokenizer("embedded:tiny", seed=0)
    state = merged.state_dict()
    # the base stays frozen; only the adapters moved, so merged weights differ from the base where adapted
    assert torch.equal(state["model.embed_tokens.weight"], base.state_dict()["model.embed_tokens.weight"])
    assert not torch.equal(state["model.layers.0.self_attn.q_proj.weight"],
                           base.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_lora_grpo_learns_a_trivially_learnable_reward(grpo_config):
    """Only the adapters train, and the sampler draws from the merged weights: if either were wrong
    (no gradient into B, or a sampler left on the base), the reward would stay at the random
    model's. Measured (seed 1): the same run with learning_rate 1e-9 scores 0.007 over the first
    3 steps and 0.01 over the last 5; this one 0.01 and ~0.12. LoRA on every linear layer cannot
    move the tiny model's output head (tied to the embeddings), so it learns this reward slower than
    full fine-tuning does (tests/algorithms/test_grpo.py: > 0.6 after 25 steps)."""
    from safetensors.torch import load_file

    from grpolab.algorithms.grpo import train_grpo
    from grpolab.training.metric_logging import read_metrics

    cfg = grpo_config(n_grpo_steps=20, rollout_batch_size=64, group_size=8, train_batch_size=64,
                      gradient_accumulation_steps=1, sampling_max_tokens=3, learning_rate=3e-2,
                      reward="tests.helpers.reward_fixtures:starts_with_7", seed=1, lora_r=8, lora_alpha=16,
                      eval_examples=4, log_generations_samples=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and far faster on a busy machine
    try:
        result = train_grpo(cfg)
    finally:
        torch.set_num_threads(threads)
    rewards = [r["train/reward"] for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert len(rewards) == 20
    assert sum(rewards[:3]) / 3 < 0.03, rewards
    assert sum(rewards[-5:]) / 5 > 0.06, rewards  # 6x the untrained run's
    config = json.loads((result.final_dir / "adapter_config.json").read_text())  # final/ is the adapter
    assert config["r"] == 8
    adapter = load_file(str(result.final_dir / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())  # B starts at 0: it trained


def test_lora_on_a_tied_output_head_is_refused_in_one_line(tiny_model):
    pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[scale]'")
    from grpolab.models.lora import apply_lora

    model, _ = tiny_model()
    assert model.config.tie_word_embeddings
    with pytest.raises(ValueError, match="lora_target_modules: 'lm_head' is tied to the input embeddings"):
        apply_lora(model, 4, 8.0, target_modules=["q_proj", "lm_head"])


def test_a_lora_runs_final_adapter_is_a_model_everywhere(tmp_path, small_run):
    """SFT with LoRA writes an adapter as final/; grpolab loads it as base + adapter (merged), equal
    to peft's own forward, and trains on from it (SFT-with-LoRA -> GRPO) and evaluates it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from grpolab.algorithms.grpo import GRPOConfig, train_grpo
    from grpolab.algorithms.sft import SFTConfig, train_sft
    from grpolab.cli import app
    from grpolab.models import ModelLoadError, save_model_and_tokenizer

    base_dir = save_model_and_tokenizer(*load_model_and_tokenizer("embedded:tiny", seed=3), tmp_path / "base")
    sft = SFTConfig(**small_run, model=str(base_dir), n_sft_steps=3, train_batch_size=8, gradient_accumulation_steps=2,
                    learning_rate=1e-2, warmup_steps=0, lora_r=4, run_dir=str(tmp_path / "sft"))
    final = train_sft(sft).final_dir
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir.resolve())
    merged, tok = load_model_and_tokenizer(str(final))
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_dir)), str(final)).eval()
    ids = torch.tensor([tok("Q: 1+2\nA: <think>")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        assert (merged(ids).logits - AutoModelForCausalLM.from_pretrained(str(base_dir))(ids).logits).abs().max() > 1e-4
    # GRPO from the adapter: the run starts from the merged policy
    grpo = GRPOConfig(**small_run, model=str(final), n_grpo_steps=1, rollout_batch_size=4, group_size=4,
                      train_batch_size=4, gradient_accumulation_steps=1, warmup_steps=0, run_dir=str(tmp_path / "grpo"))
    assert train_grpo(grpo).final_dir.joinpath("config.json").is_file()
    out = CliRunner().invoke(app, ["eval", "--model", str(final), "--data", "task:arithmetic", "--n", "2", "--k", "1",
                                   "--max-tokens", "8", "--out", str(tmp_path / "eval"), "--no-entropy"])
    assert out.exit_code == 0, out.output
    # an adapter whose base is gone, or with pickled weights only, is one line
    moved = tmp_path / "moved"
    moved.mkdir()
    config = json.loads((final / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/nowhere/base"}))
    (moved / "adapter_model.safetensors").write_bytes((final / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match="base model '/nowhere/base' is not a local directory"):
        load_model_and_tokenizer(str(moved))
    (moved / "adapter_config.json").write_text(json.dumps(config))
    (moved / "adapter_model.safetensors").unlink()
    (moved / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="pickled adapter adapter_model.bin refused"):
        load_model_and_tokenizer(str(moved))
