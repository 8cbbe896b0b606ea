"""The sync canary (issue 56): after every weight sync to a sampler with its own weights, the
sampler's tensors are read back as float64 sums and compared with what the trainer sent; a tensor not
sent (veRL #7495: a LoRA sync that delivered nothing) or not loaded stops the run with one line naming
the step. The faults are injected into the sender and the receiver; the processes are real."""

from __future__ import annotations

import pytest
import torch

from grpolab.models import load_model_and_tokenizer
from grpolab.rollout import WeightSyncError
from grpolab.rollout.base import sums_differ, sync_problem, tensor_sums
from grpolab.rollout.process import ProcessRolloutBackend

DROPPED = "model.layers.0.mlp.up_proj.weight"


def _moved(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-6)  # a step of learning rate 1e-6 size


def test_sums_tell_a_tensor_from_its_float64_reordering_and_from_one_small_step():
    t = torch.randn(4096, 64)
    a = tensor_sums(t, None)  # every value
    assert not sums_differ(a, tensor_sums(t.t().contiguous(), None))  # same values, another summation order
    assert not sums_differ(a, tensor_sums(t[torch.randperm(4096)], None))
    one = t.clone()
    one[17, 3] += 1e-6  # one element moved by a learning-rate-1e-6 step
    assert sums_differ(a, tensor_sums(one, None))
    # the default reads a fixed stride of at most 65,536 values: a tensor moved by such a step is told apart
    assert tensor_sums(t)[2] == 65_536 and sums_differ(tensor_sums(t), tensor_sums(t + 1e-6 * torch.randn_like(t)))
    assert sync_problem({"w": a}, {"w": a, "v": a}, [["w", "v"]]) is None  # tied: either name suffices
    assert "v was not sent" in sync_problem({}, {"v": a}, [["v"]])


def test_the_process_sampler_passes_a_full_sync_and_stops_on_a_dropped_tensor():
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    backend = ProcessRolloutBackend(model, tok, threads=1)
    try:
        _moved(model)
        backend.sync_weights(model)  # every tensor: passes
        _moved(model)
        with pytest.raises(WeightSyncError, match=f"sync canary: .*{DROPPED} was not sent"):
            backend.sync_weights(model, weights=[(k, v) for k, v in model.state_dict().items() if k != DROPPED])
        backend.sync_weights(model)  # a later full sync passes again
        _moved(model)
        backend.stage(model.state_dict().items())
        backend._staged[DROPPED].add_(1e-3)  # the receiver's staging copy corrupted after the send
        with pytest.raises(WeightSyncError, match=f"{DROPPED} differs"):
            backend.load_staged()
    finally:
        backend.close()


def test_the_canary_can_be_turned_off():
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    backend = ProcessRolloutBackend(model, tok, threads=1, check_sync=False)
    try:
        _moved(model)
        backend.sync_weights(model, weights=[(k, v) for k, v in model.state_dict().items() if k != DROPPED])
    finally:
        backend.close()


def test_an_async_run_whose_sync_drops_a_tensor_stops_naming_the_step(grpo_config, monkeypatch):
    from grpolab.algorithms.grpo import train_grpo
    from grpolab.training.run_model import RunModel

    full = RunModel.full_weights

    def dropping(self):  # the fault: the sender skips one parameter
        return ((k, v) for k, v in full(self) if k != DROPPED)

    monkeypatch.setattr(RunModel, "full_weights", dropping)
    with pytest.raises(WeightSyncError, match=rf"^step 0 \(policy version 1\): sync canary: .*{DROPPED} was not sent"):
        train_grpo(grpo_config(n_grpo_steps=3, max_staleness=1, eval_examples=2, log_generations_samples=0))


@pytest.mark.parametrize("drop", [False, True])
def test_a_lora_async_run_syncs_the_merged_weights_and_a_dropped_one_stops_it(grpo_config, monkeypatch, drop):
    pytest.importorskip("peft", reason="LoRA needs the scale extra (pip install -e '.[scale]')")
    from grpolab.algorithms.grpo import train_grpo
    from grpolab.training.run_model import RunModel

    full, merged = RunModel.full_weights, "model.layers.0.self_attn.q_proj.weight"  # a LoRA layer, merged

    def sender(self):
        return ((k, v) for k, v in full(self) if not (drop and k == merged))

    monkeypatch.setattr(RunModel, "full_weights", sender)
    cfg = grpo_config(n_grpo_steps=3, max_staleness=1, eval_examples=2, log_generations_samples=0, lora_r=4,
                      lora_target_modules=["q_proj", "v_proj"])
    if drop:
        with pytest.raises(WeightSyncError, match=rf"^step 0 \(policy version 1\): sync canary: .*{merged} was not"):
            train_grpo(cfg)
    else:
        assert train_grpo(cfg).final_dir.exists()
