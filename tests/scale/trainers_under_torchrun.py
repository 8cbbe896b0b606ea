"""Run by the scale tier (tests/scale/conftest.py) under ``torchrun`` (gloo, CPU): one launch, many
checks. With ``--gradients``, first SFT's, expert iteration's and DPO's gradient on 2 ranks against
one process (``tests/helpers/distributed_grad_check.py``: ``trainer_gradients``); then each named run
("<trainer>/<strategy>") trained for 2 steps through the trainer's own entry point (``train_sft``,
``train_dpo``, ``train_expert_iteration``, ``train_grpo``), ending in ``final/``. Every rank prints
where torchrun placed it; rank 0 prints {"run", "run_dir"} per run.
``python -m torch.distributed.run --nproc_per_node 2 tests/scale/trainers_under_torchrun.py OUT``
``[--gradients] [RUN ...]``"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

STRATEGIES = ("ddp", "fsdp2", "deepspeed")
SMALL = dict(model="embedded:tiny", task="arithmetic", task_train_size=40, device="cpu", show_progress=False,
             learning_rate=1e-3, max_grad_norm=1.0)
SAMPLED = dict(sampling_max_tokens=8, sampling_min_tokens=1, eval_examples=4, log_generations_samples=0)
# two optimizer steps of 8 rows in 2 micro-batches: each rank gets 4 rows, 2 per micro-batch
SETTINGS = {
    "sft": dict(SMALL, **SAMPLED, n_sft_steps=2, train_batch_size=8, gradient_accumulation_steps=2, warmup_steps=0,
                checkpoint_every=2),
    "dpo": dict(SMALL, n_dpo_steps=2, train_batch_size=8, gradient_accumulation_steps=2, eval_pairs=4,
                checkpoint_every=2),
    # the reward accepts about half the samples of the untrained model, so each step has responses to imitate
    "ei": dict(SMALL, **SAMPLED, n_ei_steps=2, ei_batch_size=8, group_size=2, train_batch_size=8,
               gradient_accumulation_steps=2, reward="tests.helpers.reward_fixtures:length_parity", checkpoint_every=2),
    "grpo": dict(SMALL, **SAMPLED, n_grpo_steps=2, rollout_batch_size=8, group_size=4, train_batch_size=8,
                 gradient_accumulation_steps=2, eval_every=0, reward="tests.helpers.reward_fixtures:length_parity",
                 checkpoint_every=2),
}
PLACEMENT = ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
RUNS = [f"{t}/{s}" for t in ("sft", "dpo", "ei") for s in STRATEGIES]


def config(run: str, run_dir: Path):
    """The config of ``run`` ("<trainer>/<strategy>", strategy ``none`` for one process)."""
    trainer, strategy = run.split("/")
    cls, _ = trainers()[trainer]
    extra = {"deepspeed_config": "configs/deepspeed_zero3.json"} if strategy == "deepspeed" else {}
    return cls.build(None, {**SETTINGS[trainer], **extra, "distributed": strategy, "run_dir": str(run_dir)})


def trainers() -> dict:
    from grpolab.algorithms.dpo import DPOConfig, train_dpo
    from grpolab.algorithms.expert_iteration import EIConfig, train_expert_iteration
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo
    from grpolab.algorithms.sft import SFTConfig, train_sft

    return {"sft": (SFTConfig, train_sft), "dpo": (DPOConfig, train_dpo), "ei": (EIConfig, train_expert_iteration),
            "grpo": (GRPOConfig, train_grpo)}


def main(out: Path, runs: list[str]) -> None:
    import torch.distributed as tdist

    tdist.init_process_group("gloo")  # once: every Run below joins this group rather than making its own
    # where torchrun placed this process: the two-node test checks it really had two nodes
    print(json.dumps({"rank": tdist.get_rank(), **{k.lower(): int(os.environ[k]) for k in PLACEMENT}}), flush=True)
    if "--gradients" in runs:  # SFT, EI and DPO gradients, 2 ranks against one process
        import torch

        from grpolab.training import distributed
        from tests.helpers.distributed_grad_check import trainer_gradients

        strategies = tuple(s for s in STRATEGIES if any(r.endswith(f"/{s}") for r in runs))
        trainer_gradients(distributed.setup("ddp", torch.device("cpu")), strategies or STRATEGIES)
        distributed.teardown()
        runs = [r for r in runs if r != "--gradients"]
    for run in runs:
        cfg = config(run, out / run.replace("/", "_"))
        trainers()[run.split("/")[0]][1](cfg)
        if tdist.get_rank() == 0:
            print(json.dumps({"run": run, "run_dir": cfg.run_dir}), flush=True)
    tdist.barrier()  # no rank leaves (and exits) while another still saves or plots: an exit mid-use can abort it
    tdist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or ["--gradients", *RUNS])
