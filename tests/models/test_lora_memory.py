"""LoRA that fits (issue 59): under bf16 the frozen base of the adapted layers is held in bf16 (adapters
fp32) without changing the policy's outputs, and the sampler's copy shares the frozen base, owning only
the merged adapted layers (in the compute dtype), refreshed one layer at a time."""

import copy

import pytest
import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.models import lora
from grpolab.training.run_model import RunModel

pytest.importorskip("peft", reason="LoRA needs peft (the scale extra)")


def _storage_bytes(*modules) -> int:
    seen = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_frozen_base_is_held_in_the_run_dtype_and_the_sampler_owns_only_merged_layers(tiny_model, dtype):
    model, _ = tiny_model()
    fp32_twin = copy.deepcopy(model)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = GRPOConfig(model="embedded:tiny", lora_r=4, lora_alpha=8, dtype=dtype, device="cpu")
    weights = RunModel(cfg, model, torch.device("cpu"), None)
    policy, replica = weights.model, weights.replica
    layers = lora.adapted_layers(policy)
    assert layers and weights.own_merged == {f"{name}.weight" for name in layers}
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert all(m.base_layer.weight.dtype == want for m in layers.values())
    assert all(p.dtype == torch.float32 for n, p in policy.named_parameters() if ".lora_" in n)
    # the sampler's copy shares every other tensor with the policy: one stored copy of the frozen base
    mine = dict(replica.named_parameters())
    policy_ptrs = {t.data_ptr() for t in (*policy.parameters(), *policy.buffers())}
    assert all((name in weights.own_merged) != (p.data_ptr() in policy_ptrs) for name, p in mine.items())
    adapted = sum(m.base_layer.weight.numel() for m in layers.values())
    adapters = sum(p.numel() for n, p in policy.named_parameters() if ".lora_" in n)
    per = 2 if dtype == "bfloat16" else 4
    buffers = sum(b.numel() * b.element_size() for b in policy.buffers())
    assert _storage_bytes(policy, replica) == 4 * (n_params - adapted) + 2 * per * adapted + 4 * adapters + buffers

    # a trained adapter: the refreshed copy holds W + BA, merged in fp32 from the stored base, rounded once
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    weights.stale = True
    weights.refresh()
    scaling = lora.lora_scaling(policy)
    for name, module in layers.items():
        b, a = module.lora_B[lora.ADAPTER].weight, module.lora_A[lora.ADAPTER].weight
        expect = (module.base_layer.weight.float() + scaling * (b @ a)).to(want)
        assert torch.equal(mine[f"{name}.weight"], expect), name

    # the policy computes as an fp32-base LoRA model does under the same autocast: bit for bit
    twin = lora.apply_lora(fp32_twin, 4, 8)
    twin.load_state_dict(lora.adapter_state_dict(policy.state_dict()), strict=False)
    ids = torch.randint(4, 40, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"), torch.no_grad():
        assert torch.equal(policy(ids).logits, twin(ids).logits)


def test_a_bf16_lora_run_validates_and_resumes_to_the_same_adapter(tmp_path, small_run):
    # validation's generation log runs the sampler's copy outside autocast (token entropies): it must run
    from grpolab.algorithms.grpo import train_grpo

    kw = dict(small_run, model="embedded:tiny", task="arithmetic", rollout_batch_size=4, group_size=2,
              train_batch_size=4, gradient_accumulation_steps=2, lora_r=4, lora_alpha=8, dtype="bfloat16",
              learning_rate=1e-3, checkpoint_every=1, threads=1, reward="tests.helpers.reward_fixtures:length_parity")
    train_grpo(GRPOConfig(run_dir=str(tmp_path / "a"), n_grpo_steps=2, **kw))
    train_grpo(GRPOConfig(run_dir=str(tmp_path / "b"), n_grpo_steps=1, **kw))
    train_grpo(GRPOConfig(run_dir=str(tmp_path / "b"), n_grpo_steps=2, **kw), resume=True)
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / r / "final" / "adapter_model.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # the adapter did train
