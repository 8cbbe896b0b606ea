"""``vllm_device`` (issue 55: CS336's layout, the policy on one GPU and vLLM on another): what it may
be combined with (config), what this machine has (at the run's start, one line naming the field), and
the GPU the server grpolab starts is shown (its CUDA_VISIBLE_DEVICES)."""

import os
import subprocess
import sys

import pytest
import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.rollout.vllm_server_io import server_visible_devices
from grpolab.training.config import ConfigError
from grpolab.training.run_setup import check_vllm_device


@pytest.mark.parametrize("fields, line", [
    (dict(vllm_device="cuda:1"), "vllm_device ('cuda:1') places a vLLM engine: set rollout_backend vllm_server"),
    (dict(vllm_device="cuda:1", rollout_backend="vllm_server", vllm_server_url="http://127.0.0.1:8000"),
     "vllm_device ('cuda:1') places the server grpolab starts"),
    (dict(vllm_device="tpu", rollout_backend="vllm_server"), "vllm_device must be cpu, cuda or cuda:N, got 'tpu'"),
])
def test_combinations_that_cannot_work_are_refused(fields, line):
    with pytest.raises(ConfigError, match=line.replace("(", r"\(").replace(")", r"\)")):
        GRPOConfig.build(overrides=fields)


def test_a_config_naming_a_second_gpu_loads_anywhere():
    cfg = GRPOConfig.build(overrides=dict(device="cuda:0", vllm_device="cuda:1", rollout_backend="vllm_server"))
    assert cfg.backend_options()["device"] == "cuda:1"


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs: cuda:1 exists")
def test_a_gpu_this_machine_lacks_is_one_line_at_the_start(tmp_path):
    cfg = GRPOConfig.build(overrides=dict(vllm_device="cuda:1", rollout_backend="vllm_server"))
    with pytest.raises(ConfigError, match=r"^vllm_device: 'cuda:1', but this (torch|machine)"):
        check_vllm_device(cfg, torch.device("cpu"))
    done = subprocess.run([sys.executable, "-m", "grpolab", "grpo", "--rollout-backend", "vllm_server",
                           "--vllm-device", "cuda:1", "--run-dir", str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("grpolab: error: vllm_device: 'cuda:1', but this")
    assert not (tmp_path / "run").exists()


def test_the_colocated_engine_stays_on_the_policys_device():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the CPU case below is not what it runs")
    check_vllm_device(GRPOConfig(rollout_backend="vllm", vllm_device="cpu"), torch.device("cpu"))  # the same: fine


def test_the_server_sees_only_its_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert (server_visible_devices("cuda:1"), server_visible_devices("cuda"), server_visible_devices("cpu")) == \
        ("3", "2", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert server_visible_devices("cuda:1") == "1"
