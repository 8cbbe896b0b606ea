"""LoRA via peft: the reference policy is the base (adapter disabled, no copy), the sampler's merged
weights compute the same policy, and a LoRA GRPO run saves its adapter and a merged model."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install 'grpolab[scale]')")

from grpolab.core import get_response_log_probs  # noqa: E402
from grpolab.models import load_model_and_tokenizer  # noqa: E402
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
        base_lp = get_response_log_probs(plain, ids, labels)["log_probs"]
        ref_lp = get_response_log_probs(AdapterDisabled(model), ids, labels)["log_probs"]
        adapted = get_response_log_probs(model, ids, labels)["log_probs"]
        plain.load_state_dict(merged_state_dict(model.state_dict(), lora_scaling(model)))
        merged = get_response_log_probs(plain, ids, labels)["log_probs"]
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
    full fine-tuning does (tests/test_algorithms_grpo.py: > 0.6 after 25 steps)."""
    from safetensors.torch import load_file

    from grpolab.algorithms.grpo import train_grpo
    from grpolab.algorithms.metrics import read_metrics

    cfg = grpo_config(n_grpo_steps=20, rollout_batch_size=64, group_size=8, train_batch_size=64,
                      gradient_accumulation_steps=1, sampling_max_tokens=3, learning_rate=3e-2,
                      reward="tests.reward_fixtures:starts_with_7", seed=1, lora_r=8, lora_alpha=16,
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
    pytest.importorskip("peft", reason="peft is not installed: pip install 'grpolab[scale]'")
    from grpolab.models.lora import apply_lora

    model, _ = tiny_model()
    assert model.config.tie_word_embeddings
    with pytest.raises(ValueError, match="lora_target_modules: 'lm_head' is tied to the input embeddings"):
        apply_lora(model, 4, 8.0, target_modules=["q_proj", "lm_head"])
