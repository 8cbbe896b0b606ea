"""Distributed GRPO on real processes: 2 ``gloo`` ranks started by ``torchrun`` in a subprocess
(a free ``--master_port``, a timeout). Gradient equality 1 vs 2 ranks for every length
normalisation and loss type (DDP and FSDP2), a 3-step run per strategy ending in a loadable model
(under FSDP2 with a LoRA adapter), and SIGKILL + resume to identical weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.training.config import ConfigError
from tests.helpers.torchrun import (  # noqa: F401
    ROOT,
    RUN,
    TORCHRUN,
    _env,
    _port,
    json_rows,
    kill_after_first_checkpoint,
    kill_job,
    torchrun,
)


def weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_gradient_two_ranks_equals_one_for_every_normalisation_and_loss():
    out = torchrun(["tests/helpers/distributed_grad_check.py"])
    rows = json_rows(out.stdout)
    from grpolab.core import LENGTH_NORMALIZATIONS, policy_loss_names
    from tests.helpers.distributed_grad_check import ADVANTAGE_CASES

    # the advantages the trainer computes on 2 ranks (no injection) equal one process's, batch-wide
    # statistics included (scale_rewards: batch, REINFORCE++, whitening were per rank before)
    advantages = [r for r in rows if r["case"].startswith("advantages/")]
    assert {r["case"] for r in advantages} == {f"advantages/{c}" for c in ADVANTAGE_CASES}
    assert all(r["max_abs_diff"] <= 1e-6 and r["scale"] > 0.1 for r in advantages), advantages
    rows = [r for r in rows if not r["case"].startswith("advantages/")]
    assert len(rows) == 2 * (len(LENGTH_NORMALIZATIONS) * len(policy_loss_names()) + 1)
    for row in rows:
        assert row["scale"] > 1e-3, row  # a real gradient, not zero against zero
        assert row["max_abs_diff"] <= 1e-6, row


# one run per strategy; the FSDP2 one trains a LoRA adapter (full fine-tuning under FSDP2 is the
# SIGKILL + resume test's), with a reward that varies within groups so that the adapter moves
LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lora-save-merged", "true", "--learning-rate", "0.003",
        "--reward", "tests.helpers.reward_fixtures:length_parity"]
CASES = {"ddp": [], "fsdp2+lora": LORA, "deepspeed": ["--deepspeed-config", "configs/deepspeed_zero3.json"]}


@pytest.mark.parametrize("case", list(CASES))
def test_three_grpo_steps_end_in_a_loadable_model(tmp_path, case):
    strategy = case.split("+")[0]
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[scale]')")
    if "lora" in case:
        pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[scale]')")
    run_dir = tmp_path / strategy
    torchrun([*RUN, "--distributed", strategy, "--run-dir", str(run_dir), "--checkpoint-every", "3", *CASES[case]])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"))
    assert sum(p.numel() for p in model.parameters()) > 100_000
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["grpo_step"] for r in records if "train/reward" in r]
    assert steps == [0, 1, 2]  # rank 0 wrote every step, once
    if "lora" in case:
        check_lora_final(run_dir, model.state_dict(), scaling=8 / 4)
        return
    start = AutoModelForCausalLM.from_pretrained(str(run_dir / "checkpoints" / "step_3"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), start.state_dict().values()))


def check_lora_final(run_dir: Path, merged: dict, scaling: float) -> None:
    """final/ is the merged model and final/adapter/ the trained adapter; the checkpoint holds the
    frozen base; merged = base + scaling * B A for every adapted layer (the pieces fit together)."""
    from safetensors.torch import load_file

    assert json.loads((run_dir / "final" / "adapter" / "adapter_config.json").read_text())["r"] == 4
    adapter = load_file(str(run_dir / "final" / "adapter" / "adapter_model.safetensors"))
    base = weights(run_dir / "checkpoints" / "step_3")
    pairs = [(k[len("base_model.model."):-len(".lora_A.weight")], k) for k in adapter if k.endswith(".lora_A.weight")]
    assert len(pairs) == 7 * 5  # all-linear: q, k, v, o, gate, up, down in each of the tiny model's 5 layers
    assert max(float(adapter[k.replace("lora_A", "lora_B")].abs().max()) for _, k in pairs) > 1e-4  # B = 0 at the start
    for stem, key in pairs:
        delta = scaling * adapter[key.replace("lora_A", "lora_B")] @ adapter[key]
        assert torch.allclose(merged[f"{stem}.weight"], base[f"{stem}.weight"] + delta, atol=1e-6), stem
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_sigkill_and_resume_with_two_ranks_gives_identical_weights(tmp_path, strategy):
    """The sharded optimizer state is read back without unpickling code (DCP metadata through an
    allow-list, DeepSpeed files with weights_only=True) and the resumed run ends bit-identical."""
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[scale]')")
    extra = ["--deepspeed-config", "configs/deepspeed_zero3.json"] if strategy == "deepspeed" else []
    args = [*RUN, "--distributed", strategy, *extra, "--checkpoint-every", "1", "--learning-rate", "0.003"]
    torchrun([*args, "--run-dir", str(tmp_path / "whole")])
    killed = tmp_path / "killed"
    cmd = [*TORCHRUN, "--master_port", str(_port()), *args, "--run-dir", str(killed)]
    kill_after_first_checkpoint(cmd, killed, 600)  # torchrun and both ranks, mid-run
    out = torchrun([*RUN[:2], "grpo", "--resume", str(killed)])
    resumed = re.findall(r"grpolab: resuming from .*step_(\d+)", out.stderr)
    assert len(resumed) == 1 and int(resumed[0]) < 3, out.stderr[-2000:]  # rank 0 says which checkpoint, once
    a, b = weights(tmp_path / "whole" / "final"), weights(killed / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_combinations_are_one_line_config_errors():
    base = dict(task="arithmetic", device="cpu")
    for fields, words in [({"deepspeed_config": "x.json"}, "distributed: deepspeed"),
                          ({"fsdp_cpu_offload": True}, "fsdp2"),
                          ({"lora_r": 4, "distributed": "deepspeed"}, "ddp or fsdp2"),
                          ({"lora_r": 4, "lora_dropout": 0.1}, "disable_dropout"),
                          ({"lora_save_merged": True}, "lora_r"),
                          ({"rollout_backend": "vllm", "distributed": "ddp", "vllm_tensor_parallel_size": 2},
                           "each rank runs its own engine")]:
        with pytest.raises(ConfigError, match=words) as err:
            GRPOConfig.build(None, {**base, **fields})
        assert "\n" not in str(err.value)


ONE_RANK_FAILS = """
import sys
from grpolab.training import distributed
from grpolab.algorithms.grpo import GRPOConfig
from grpolab.training.run import Run

cfg = GRPOConfig(distributed="ddp", device="cpu", run_dir=sys.argv[1], show_progress=False, task_train_size=8)
with Run(cfg) as run:
    if run.is_main:  # e.g. a full disk under rank 0's checkpoint: this rank fails alone
        raise SystemExit("rank 0 fails alone")
    distributed.all_gather_objects(1)  # the other rank waits in a training collective rank 0 never joins
"""


def test_a_rank_failing_alone_ends_the_job_instead_of_waiting_for_the_others(tmp_path):
    """The failing rank leaves its group without a barrier and exits; torchrun then stops the rank
    still waiting in its collective. With a barrier on the way out the two ranks would wait in two
    different collectives until gloo's 30-minute timeout (and this test's 180 s)."""
    script = tmp_path / "one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS)
    out = torchrun([str(script), str(tmp_path / "run")], timeout=180, check=False)
    assert out.returncode != 0 and "rank 0 fails alone" in out.stderr, out.stderr[-2000:]


def test_distributed_none_under_torchrun_is_refused(tmp_path):
    out = torchrun([*RUN, "--run-dir", str(tmp_path / "r")], timeout=120, check=False)
    assert out.returncode != 0
    assert "distributed: none, but torchrun started 2 processes" in out.stderr


def test_ppo_under_an_engine_is_refused_with_its_reason():
    """PPO's critic is added after the engine wraps the policy: refused in one line that says so."""
    from grpolab.algorithms.ppo import PPOConfig
    from grpolab.training.distributed import Dist
    from grpolab.training.run_model import check_distributed

    for strategy in ("ddp", "fsdp2", "deepspeed"):
        with pytest.raises(ConfigError, match="value head is trained outside the engine's wrapping") as err:
            check_distributed(PPOConfig(distributed=strategy, device="cpu"), Dist(strategy, world_size=2))
        assert "\n" not in str(err.value) and "for now" not in str(err.value)
