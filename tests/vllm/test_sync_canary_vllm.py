"""The sync canary on a colocated vLLM engine (issue 56): vLLM on the CPU packs its linear weights for
its kernels, so the canary reads them through the engine's log-probs of a fixed probe sequence; a sync
whose sender drops a tensor stops the run with one line naming the step, a full sync passes."""

import pytest
import torch

from grpolab.rollout import WeightSyncError
from grpolab.rollout.base import probe_ids, probe_tolerance
from grpolab.training.run_model import RunModel

DROPPED = "model.layers.0.mlp.down_proj.weight"
DIGIT = "tests.helpers.reward_fixtures:reward_any_digit"  # the random tiny model earns it sometimes: updates apply


def test_a_vllm_run_passes_full_syncs_and_stops_when_the_sender_drops_a_tensor(grpo_config, monkeypatch):
    from grpolab.algorithms.grpo import train_grpo

    checked = []
    check = RunModel.check_sync

    def recording(self, backend, step=None):
        checked.append(step)
        ids = probe_ids(self._peft().get_input_embeddings().num_embeddings)
        assert len(backend.probe_log_probs(ids)) == len(ids) - 1
        return check(self, backend, step)

    monkeypatch.setattr(RunModel, "check_sync", recording)
    result = train_grpo(grpo_config(n_grpo_steps=2, rollout_backend="vllm", eval_examples=2, reward=DIGIT))
    assert checked == [0, 1] and result.final_dir.exists()  # every full sync checked, and passed

    full = RunModel.full_weights

    def dropping(self):  # the fault: the sender skips one parameter
        return ((k, v) for k, v in full(self) if k != DROPPED)

    monkeypatch.setattr(RunModel, "full_weights", dropping)
    with pytest.raises(WeightSyncError, match=r"^step 0: sync canary: the rollout engine's log-probs .* float32"):
        train_grpo(grpo_config(n_grpo_steps=2, rollout_backend="vllm", eval_examples=2, learning_rate=1e-2,
                               reward=DIGIT, run_dir=str(result.final_dir.parent.parent / "dropped")))


def test_a_vllm_server_run_passes_full_syncs_and_stops_when_the_sender_drops_a_tensor(grpo_config, monkeypatch,
                                                                                      tmp_path):
    from grpolab.algorithms.grpo import train_grpo

    checked, check = [], RunModel.check_sync
    monkeypatch.setattr(RunModel, "check_sync", lambda self, backend, step=None: (checked.append(step),
                                                                                  check(self, backend, step)))
    train_grpo(grpo_config(n_grpo_steps=2, rollout_backend="vllm_server", eval_examples=2, reward=DIGIT,
                           run_dir=str(tmp_path / "full")))
    assert checked == [0, 1]  # every full sync checked through the server's prompt log-probs, and passed
    full = RunModel.full_weights
    monkeypatch.setattr(RunModel, "full_weights", lambda self: ((k, v) for k, v in full(self) if k != DROPPED))
    with pytest.raises(WeightSyncError, match=r"^step 0: sync canary: the rollout engine's log-probs .* float32"):
        train_grpo(grpo_config(n_grpo_steps=2, rollout_backend="vllm_server", eval_examples=2, learning_rate=1e-2,
                               reward=DIGIT, run_dir=str(tmp_path / "server")))


def test_an_async_vllm_server_run_checks_each_loaded_version_and_stops_when_the_sender_drops_a_tensor(
        grpo_config, monkeypatch, tmp_path):
    """max_staleness 1: the producer loads version 1 into the server between two batches; the trainer's
    probe log-probs staged with it must be the server's after the load (3 steps: version 2 has no batch)."""
    from grpolab.algorithms import grpo_sampling
    from grpolab.algorithms.grpo import train_grpo

    checked, check = [], grpo_sampling.check_probe
    monkeypatch.setattr(grpo_sampling, "check_probe", lambda *a: (checked.append(a[2]), check(*a)))
    cfg = dict(n_grpo_steps=3, max_staleness=1, rollout_backend="vllm_server", eval_examples=2, sampling_min_tokens=0,
               reward="tests.helpers.reward_fixtures:length_parity", skip_zero_advantage=False)
    train_grpo(grpo_config(**cfg, run_dir=str(tmp_path / "full")))
    assert checked == [torch.float32]  # version 1 loaded, checked through the server's prompt log-probs, passed
    full = RunModel.full_weights
    monkeypatch.setattr(RunModel, "full_weights", lambda self: ((k, v) for k, v in full(self) if k != DROPPED))
    with pytest.raises(WeightSyncError, match=r"^step 0 \(policy version 1\): sync canary: the rollout engine's "
                                              r"log-probs .* float32"):
        train_grpo(grpo_config(**cfg, learning_rate=1e-2, run_dir=str(tmp_path / "dropped")))


def test_the_tolerance_follows_the_engines_dtype():
    assert probe_tolerance(torch.float32) == 1e-3
    assert probe_tolerance(torch.bfloat16) == pytest.approx(0.0625)
