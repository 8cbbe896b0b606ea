"""The scale tier (``make test-scale``): real multi-process ``torchrun`` jobs (gloo, CPU). One
session-wide launch (``trainer_runs``) trains every trainer under every strategy and checks their
gradients, so the tier pays torch's start-up and DeepSpeed's set-up once, not per check."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.torchrun import json_rows, torchrun


def has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def need(strategy: str) -> None:
    """Skip, in one line, a check whose engine is not installed."""
    if strategy == "deepspeed" and not has_deepspeed():
        pytest.skip("deepspeed is not installed (pip install -e '.[scale]')")


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory):
    """One ``torchrun --nproc_per_node 2`` launch of tests/scale/trainers_under_torchrun.py: the
    SFT/EI/DPO gradient rows and every trainer/strategy run (plus the GRPO run the two-node test
    compares with). Returns {"gradients": [rows], "runs": {"sft/ddp": run_dir, ...}}."""
    from tests.scale.trainers_under_torchrun import RUNS

    runs = [r for r in RUNS if has_deepspeed() or not r.endswith("/deepspeed")] + ["grpo/fsdp2"]
    out = tmp_path_factory.mktemp("trainers")
    done = torchrun(["tests/scale/trainers_under_torchrun.py", str(out), "--gradients", *runs], timeout=900)
    rows = json_rows(done.stdout)
    return {"gradients": [r for r in rows if "case" in r],
            "runs": {r["run"]: Path(r["run_dir"]) for r in rows if "run" in r}}
