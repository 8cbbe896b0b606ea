"""SFT's validation and expert iteration's sampling through a vLLM engine (``rollout_backend: vllm``)
and a vLLM server (``vllm_server``), as CS336 uses vLLM (issue 55): every sample the engine returns
carries the log-probs of the trainer's weights at that moment (synced before each validation and each
EI sampling round), not of the weights it started with. And the two-device layout's code path on the
CPU: GRPO on a server placed by ``vllm_device: cpu`` syncs every step."""

import copy

import pytest

import grpolab.algorithms.expert_iteration as ei
import grpolab.algorithms.sft as sft
from grpolab.algorithms.expert_iteration import EIConfig, train_expert_iteration
from grpolab.algorithms.grpo import train_grpo
from grpolab.algorithms.sft import SFTConfig, train_sft
from tests.algorithms.test_grpo import step_records
from tests.vllm.test_vllm_server import LOGPROB_TOL, largest_gap

BACKENDS = ["vllm", "vllm_server"]
SMALL = dict(model="embedded:tiny", task="arithmetic", task_train_size=16, eval_examples=4, sampling_max_tokens=8,
             sampling_min_tokens=0,  # min_tokens' renormalised log-probs are documented apart
             train_batch_size=8, gradient_accumulation_steps=1, show_progress=False, device="cpu",
             log_generations_samples=0)


def _watch(monkeypatch, module):
    """Record, at every ``generate`` of the run's backend, the largest gap between the engine's
    log-probs and those of the trainer's weights then and of its weights at the start."""
    gaps, real = [], module.run_backend

    def watched(run, generator=None):
        backend = real(run, generator)
        start = copy.deepcopy(run.sampling_model)
        generate = backend.generate

        def record(prompts, n, sampling):
            out = generate(prompts, n, sampling)
            now = copy.deepcopy(run.sampling_model)
            gaps.append((largest_gap(now, out, sampling.temperature), largest_gap(start, out, sampling.temperature)))
            return out

        backend.generate = record
        return backend

    monkeypatch.setattr(module, "run_backend", watched)
    return gaps


@pytest.mark.parametrize("backend", BACKENDS)
def test_sft_validation_samples_the_current_weights_through_vllm(tmp_path, monkeypatch, backend):
    gaps = _watch(monkeypatch, sft)
    train_sft(SFTConfig(**SMALL, rollout_backend=backend, n_sft_steps=3, eval_every=1, learning_rate=1e-2,
                        warmup_steps=0, run_dir=str(tmp_path / "sft")))
    assert len(gaps) == 4  # before, after steps 1 and 2, at the end: each through the engine
    assert all(now <= LOGPROB_TOL for now, _ in gaps), gaps  # the trainer's weights of that moment
    assert gaps[-1][1] > 0.05, gaps  # ... which had moved: an engine left with the start's would show it


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_iteration_samples_the_current_weights_through_vllm(tmp_path, monkeypatch, backend):
    gaps = _watch(monkeypatch, ei)
    result = train_expert_iteration(EIConfig(**SMALL, rollout_backend=backend, n_ei_steps=3, ei_batch_size=8,
                                             group_size=2, learning_rate=1e-2,
                                             reward="tests.helpers.reward_fixtures:reward_any_digit",
                                             run_dir=str(tmp_path / "ei")))
    assert len(gaps) == 4  # three sampling rounds and the final validation
    assert all(now <= LOGPROB_TOL for now, _ in gaps), gaps
    assert gaps[-1][1] > 0.05, gaps
    steps = [r for r in result.metrics_path.read_text().splitlines() if '"ei/filtered_size"' in r]
    assert len(steps) == 3 and all('"time/weight_sync_s"' in r for r in steps)


def test_grpo_on_a_server_placed_by_vllm_device_syncs_every_step(grpo_config):
    """The handout's two-device layout's code path (the server grpolab starts is placed by
    ``vllm_device``; CUDA_VISIBLE_DEVICES names its device, none for cpu), here with the CPU's
    shared-memory weight transfer: the server's log-probs are the trainer's after each step."""
    cfg = grpo_config(rollout_backend="vllm_server", vllm_device="cpu", n_grpo_steps=2, sampling_min_tokens=0,
                      reward="tests.helpers.reward_fixtures:length_parity")
    records = step_records(train_grpo(cfg))
    assert len(records) == 2
    for r in records:
        assert r["time/weight_sync_s"] > 0 and r["train/rows_trained"] > 0
        assert r["health/logprob_mismatch_tokens"] > 0 and r["health/logprob_mismatch"] < 1e-4
