"""Multi-turn tool use under torchrun (the HF backend; the vLLM engines' case is
tests/vllm/test_scale_vllm.py): 2 gloo ranks under FSDP2 training a LoRA adapter on the calculator
questions, each rank running its own share of the prompts through the tools — a different number of
turns per rank — with the sampler's log-probs of the model's tokens equal to the trainer's."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import load_file

from tests.helpers.tool_models import ENV, tool_questions, tool_using_model
from tests.helpers.torchrun import torchrun


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    return tool_using_model(tmp_path_factory.mktemp("tool_model"))


def test_tool_env_with_lora_on_two_fsdp2_ranks(tmp_path, tool_model_dir):
    pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[scale]')")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(q) + "\n" for q in tool_questions()))
    run_dir = tmp_path / "run"
    cfg = dict(model=str(tool_model_dir), train_data=str(tmp_path / "train.jsonl"), prompt_template="compact", env=ENV,
               n_grpo_steps=3, rollout_batch_size=16, group_size=4, train_batch_size=16, gradient_accumulation_steps=2,
               sampling_max_tokens=40, sampling_min_tokens=0, sampling_temperature=1.5, learning_rate=3e-3,
               lora_r=4, lora_alpha=8, eval_every=0, eval_examples=4, log_generations_samples=0, show_progress=False,
               device="cpu", checkpoint_every=3, run_dir=str(run_dir))
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    torchrun(["-m", "grpolab", "grpo", "--config", str(tmp_path / "grpo.yaml"), "--distributed", "fsdp2"], timeout=600)
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/reward" in r]
    assert [r["grpo_step"] for r in records] == [0, 1, 2]  # rank 0 wrote every step once
    assert sum(r["train/rows_trained"] for r in records) > 0
    for r in records:
        assert r["tools/call_rate"] > 0.3 and r["tools/observation_tokens"] > 0, r  # real tool calls on both ranks
        if "health/logprob_mismatch" in r:  # measured on the trained rows: the merged sampler = the adapted trainer,
            # up to the merge's fp32 rounding (tests/vllm/test_scale_vllm.py's LoRA test)
            assert r["health/logprob_mismatch"] <= 1e-6 and r["health/logprob_mismatch_max"] <= 5e-5, r
    adapter = load_file(str(run_dir / "final" / "adapter_model.safetensors"))
    assert (
        max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k) > 0
    )  # the adapter trained (B starts at 0)
