"""vLLM rollouts at scale, on real engines: 2 ``gloo`` ranks under ``torchrun`` (DDP, FSDP2,
DeepSpeed ZeRO-3), each rank with its own colocated engine sampling its share of the prompts, the
full weights streamed into every engine one gathered parameter at a time after each update (at
most one decoder layer alive beyond the shard); and vLLM with a LoRA adapter (the merged weights
streamed). The exactness of one process: on every step the sampler's log-prob of every sampled
token equals the trainer's within 1e-5 (fp32), the same seed gives the same run, and SIGKILL +
``--resume`` ends bit-identical. Multi-turn tools run through the engines on 2 ranks and with LoRA."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.torchrun import ROOT, RUN, TORCHRUN, _env, _port, kill_after_first_checkpoint, torchrun

# DeepSpeed JIT-builds its CPU op once per venv (as tests/scale/conftest.py keeps it: beside the venv)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
LOGPROB_TOL = 1e-5  # fp32 sampler and trainer
# sampling_min_tokens 0: vLLM reports the first min_tokens log-probs in the distribution renormalised
# without the end ids (documented in rollout.vllm); a varying reward, so every step trains and syncs
VLLM = ["--rollout-backend", "vllm", "--sampling-min-tokens", "0", "--reward",
        "tests.helpers.reward_fixtures:length_parity", "--learning-rate", "0.003", "--vllm-cpu-kvcache-space-gib", "1"]
# the sharded strategies here; DDP (whole weights on every rank, streamed as they are) is the tool
# test's: 2 DDP ranks with an engine each
STRATEGY = {"fsdp2": [], "deepspeed": ["--deepspeed-config", "configs/deepspeed_zero3.json"]}


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/reward" in r]


def assert_exact_sampler(records: list[dict], steps: int, tol: float = LOGPROB_TOL) -> None:
    """Every step: every sampled token measured (the IS correction's old log-probs: all rows), the
    worst |sampler - trainer| log-prob within the tolerance, and the engine synced after the update;
    some rows trained (a step whose groups all tie still moves AdamW's weights by its moments)."""
    assert [r["grpo_step"] for r in records] == list(range(steps))
    assert sum(r["train/rows_trained"] for r in records) > 0
    for r in records:
        assert r["health/logprob_mismatch_tokens"] > 0, r
        assert r["health/logprob_mismatch_max"] <= tol, r
        assert r["time/weight_sync_s"] > 0, r


def layer_mb(final: Path) -> tuple[float, float]:
    """(largest decoder layer or other tensor, whole model) of a saved model, in MiB."""
    sizes: dict[str, float] = {}
    for name, t in load_file(str(final / "model.safetensors")).items():
        unit = ".".join(name.split(".")[:3]) if ".layers." in name else name  # model.layers.N
        sizes[unit] = sizes.get(unit, 0.0) + t.numel() * t.element_size() / 2**20
    return max(sizes.values()), sum(sizes.values())


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """One 3-step FSDP2 + vLLM run, checkpointing every step: the strategy test's and the resume test's."""
    run_dir = tmp_path_factory.mktemp("fsdp2") / "run"
    torchrun([*RUN, "--distributed", "fsdp2", *VLLM, "--checkpoint-every", "1", "--run-dir", str(run_dir)], timeout=400)
    return run_dir


@pytest.mark.parametrize("strategy", list(STRATEGY))
def test_two_ranks_with_an_engine_each_sample_the_trainers_distribution_after_every_sync(strategy, tmp_path, request):
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[scale]')")
    if strategy == "fsdp2":
        run_dir = request.getfixturevalue("fsdp2_run")
    else:
        run_dir = tmp_path / strategy
        torchrun([*RUN, "--distributed", strategy, *STRATEGY[strategy], *VLLM, "--run-dir", str(run_dir)], timeout=400)
    records = step_records(run_dir)
    assert_exact_sampler(records, 3)
    largest, whole = layer_mb(run_dir / "final")
    gathered = [r["memory/weight_sync_gathered_mb_max"] for r in records]
    # gathered one parameter at a time; vLLM holds a layer's pieces until its fused weights (qkv,
    # gate_up) are whole: at most one decoder layer beyond the shard, never the model
    assert all(0 < g <= largest < whole / 4 for g in gathered), (gathered, largest, whole)


def test_fsdp2_ranks_send_a_vllm_server_the_full_weights_one_layer_at_a_time(tmp_path):
    """Two FSDP2 ranks, one `vllm serve` (rank 0 starts it, both sample through it): after every update
    rank 0 streams the gathered weights to it by vLLM's weight-transfer protocol, never holding more
    than a layer beyond its shard, and the server then samples the trainer's distribution."""
    run_dir = tmp_path / "server"
    server = [a if a != "vllm" else "vllm_server" for a in VLLM]
    torchrun([*RUN, "--distributed", "fsdp2", *server, "--run-dir", str(run_dir)], timeout=500)
    records = step_records(run_dir)
    assert_exact_sampler(records, 3)
    largest, whole = layer_mb(run_dir / "final")
    gathered = [r["memory/weight_sync_gathered_mb_max"] for r in records]
    assert all(0 < g <= largest < whole / 4 for g in gathered), (gathered, largest, whole)


def test_sigkill_and_resume_with_an_engine_per_rank_ends_bit_identical(fsdp2_run, tmp_path):
    """The killed run's steps before the kill equal the whole run's (the seed reproduces the run),
    and its resumed end is the whole run's, bit for bit."""
    killed = tmp_path / "killed"
    cmd = [*TORCHRUN, "--master_port", str(_port()), *RUN, "--distributed", "fsdp2", *VLLM, "--checkpoint-every", "1",
           "--run-dir", str(killed)]
    kill_after_first_checkpoint(cmd, killed, 300)  # torchrun, both ranks and their engines, mid-run
    def figures(records):  # all but the timings
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]

    before = figures(step_records(killed))
    assert before and before == figures(step_records(fsdp2_run))[: len(before)]  # same seed: same rollouts, figures
    out = torchrun([*RUN[:2], "grpo", "--resume", str(killed)], timeout=400)
    resumed = re.findall(r"grpolab: resuming from .*step_(\d+)", out.stderr)
    assert len(resumed) == 1 and int(resumed[0]) < 3, out.stderr[-2000:]  # from a checkpoint of the killed run
    assert_exact_sampler(step_records(killed), 3)
    a, b = (load_file(str(fsdp2_run / "final" / "model.safetensors")),
            load_file(str(killed / "final" / "model.safetensors")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def tool_run_config(tmp_path: Path, model_dir: Path, **fields) -> Path:
    """A GRPO config on the calculator questions with the tool environment (tests.helpers.tool_models)."""
    import yaml

    from tests.helpers.tool_models import ENV, tool_questions

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(q) + "\n" for q in tool_questions()))
    cfg = {**dict(model=str(model_dir), train_data=str(tmp_path / "train.jsonl"), prompt_template="compact", env=ENV,
               rollout_backend="vllm", n_grpo_steps=3, rollout_batch_size=16, group_size=4, train_batch_size=16,
               gradient_accumulation_steps=2, sampling_max_tokens=40, sampling_min_tokens=0, learning_rate=1e-3,
               sampling_temperature=1.5,  # the SFT model is near-certain at T=1: groups would not vary
               eval_every=0, eval_examples=4, log_generations_samples=0, show_progress=False, device="cpu",
               checkpoint_every=3, vllm_cpu_kvcache_space_gib=1, run_dir=str(tmp_path / "run")), **fields}
    path = tmp_path / "grpo_tools.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def assert_tool_steps(records: list[dict], tol: float = LOGPROB_TOL) -> None:
    assert_exact_sampler(records, 3, tol)  # on the model's tokens, the observations in context
    for r in records:
        assert r["tools/call_rate"] > 0.3 and r["tools/observation_tokens"] > 0, r  # multi-turn, through the engines


@pytest.fixture(scope="module")
def tool_error(tool_model_dir) -> dict[str, float]:
    """One float32 computation's worst and mean distance from float64 (``tests.helpers.rounding``)
    on the tool model's tokens at the runs' temperature, measured here (worst 1.1e-5 under ATen's
    default kernels, 1.5e-5 under AVX2's, on an AVX2 CPU)."""
    from grpolab.models import load_model_and_tokenizer
    from tests.helpers.rounding import float32_logprob_error
    from tests.helpers.tool_models import tool_prompts

    model, tok = load_model_and_tokenizer(str(tool_model_dir))
    return float32_logprob_error(model, tok, tool_prompts(), max_tokens=40, temperature=1.5)


def tool_tol(error: dict[str, float], key: str = "max") -> float:
    """The tolerance between the engines' and the trainer's float32 log-probs on the tool model:
    four times one computation's error. Two implementations each sit within about that of the
    exact value, and vLLM's and peft's kernels round differently again; a stale or wrong weight is
    off by ~1e-3 and more."""
    return 4 * error[key]


def test_tool_environment_on_two_ranks_with_an_engine_each(tmp_path, tool_model_dir, tool_error):
    """Multi-turn rollouts under torchrun: each rank's engine runs its own number of turns (no
    collective inside a generate call), and the streamed weights keep every engine exact."""
    config = tool_run_config(tmp_path, tool_model_dir)
    torchrun(["-m", "grpolab", "grpo", "--config", str(config), "--distributed", "ddp"], timeout=400)
    records = step_records(tmp_path / "run")
    assert_tool_steps(records, tol=tool_tol(tool_error))
    # DDP: whole weights on every rank, streamed as they are: nothing gathered or copied
    assert all(r["memory/weight_sync_gathered_mb_max"] == 0.0 for r in records)


def test_lora_with_vllm_samples_from_base_plus_adapter_with_tools(tmp_path, tool_model_dir, tool_error):
    """One process, a LoRA adapter, the tool environment: the engine gets W + (alpha/r) B A after
    every update (merged as it streams, one layer at a time) and samples exactly what the adapted
    trainer scores; the adapter moved."""
    config = tool_run_config(tmp_path, tool_model_dir, lora_r=4, lora_alpha=8, learning_rate=3e-3)
    out = subprocess.run([TORCHRUN[0], "-m", "grpolab", "grpo", "--config", str(config)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    records = step_records(tmp_path / "run")
    # the engine computes with W + s B A rounded once to fp32, peft with W x + s B (A x): the same
    # function, rounded differently (worst token measured 1.1e-5 in one run)
    assert_tool_steps(records, tol=tool_tol(tool_error))
    assert all(r["health/logprob_mismatch"] <= tool_tol(tool_error, "mean") for r in records), records
    assert all(r["memory/weight_sync_gathered_mb_max"] > 0 for r in records)  # merged tensors were made and sent
    adapter = load_file(str(tmp_path / "run" / "final" / "adapter_model.safetensors"))
    assert max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k) > 0  # B starts at 0
