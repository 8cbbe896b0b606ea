"""Newcomer papercuts: a config with train_data and no task, one convention for boolean flags,
tokenizers saved without loader options."""

import json
import os
import subprocess
import sys

import pytest

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.algorithms.sft import SFTConfig
from grpolab.cli import boolean_flag_values
from grpolab.training.config import ConfigError, parse_overrides
from tests.helpers.chat_models import chat_model_dir

PAIRS = [{"prompt": "Q: 1+1\nA: <think>", "response": "1+1=2</think> <answer>2</answer>"}] * 8


def _pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return path


def test_train_data_without_task_means_no_embedded_task(tmp_path):
    data = _pairs(tmp_path)
    (tmp_path / "sft.yaml").write_text(f"model: embedded:tiny\ntrain_data: {data}\nn_sft_steps: 2\n")
    assert SFTConfig.build(tmp_path / "sft.yaml").task is None  # YAML
    assert SFTConfig.build(None, parse_overrides(["--train-data", str(data)])).task is None  # command line
    assert GRPOConfig.build(None, {"train_data": str(data)}).task is None
    assert SFTConfig.build(None, {}).task == "arithmetic"  # no data named at all: the embedded default
    with pytest.raises(ConfigError, match="give exactly one of task"):  # both given explicitly
        SFTConfig.build(None, {"train_data": str(data), "task": "arithmetic"})


def test_every_boolean_takes_flag_true_and_false():
    # config fields (--field value): a bare --flag is true, even before another option
    cfg = SFTConfig.build(None, parse_overrides(["--show-progress", "--n-sft-steps", "3", "--deterministic"]))
    assert (cfg.show_progress, cfg.n_sft_steps, cfg.deterministic) == (True, 3, True)
    cfg = SFTConfig.build(None, parse_overrides(["--show-progress", "false", "--deterministic=true"]))
    assert (cfg.show_progress, cfg.deterministic) == (False, True)
    for bare in (["--n-sft-steps"], ["--n-sft-steps", "--seed", "1"]):  # never a silent 1 (True as an int)
        with pytest.raises(ConfigError, match="--n-sft-steps needs a value"):
            SFTConfig.build(None, parse_overrides(bare))
    # typer's own flags take a value too
    assert boolean_flag_values(["grpo", "--overwrite", "true", "--n-grpo-steps", "3"]) == \
        ["grpo", "--overwrite", "--n-grpo-steps", "3"]
    assert boolean_flag_values(["sft", "--overwrite", "False"]) == ["sft"]
    assert boolean_flag_values(["eval", "--entropy", "false"]) == ["eval", "--no-entropy"]
    assert boolean_flag_values(["compare", "--ei", "yes"]) == ["compare", "--ei"]
    assert boolean_flag_values(["demo", "--tools"]) == ["demo", "--tools"]
    assert boolean_flag_values(["sft", "--run-dir", "true"]) == ["sft", "--run-dir", "true"]  # not a flag: untouched


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_overwrite_true_and_false_on_the_command_line(tmp_path):
    data = _pairs(tmp_path)
    run = [sys.executable, "-m", "grpolab", "sft", "--model", "embedded:tiny", "--train-data", str(data),
           "--n-sft-steps", "1", "--train-batch-size", "4", "--gradient-accumulation-steps", "1",
           "--eval-examples", "1", "--show-progress", "false", "--run-dir", str(tmp_path / "run")]
    first = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(run + ["--overwrite", "true"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    refused = subprocess.run(run + ["--overwrite", "false"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr, refused.stderr


def test_saved_tokenizers_carry_no_loader_options(tmp_path):
    from grpolab.models import load_tokenizer

    model_dir = chat_model_dir(tmp_path / "m")
    load_tokenizer(str(model_dir)).save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert not {"local_files_only", "is_local", "trust_remote_code"} & set(saved)
    assert saved["eos_token"] == "<|im_end|>"  # what was loaded is saved


def test_too_little_address_space_to_start_is_one_line(tmp_path):  # Z06
    """Under ``ulimit -v`` 300 MB the shared libraries torch loads (libtorch_cpu.so is larger) cannot be
    mapped: one line saying so and what the limit is, not chained import tracebacks."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (300 * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))

    done = subprocess.run([sys.executable, "-m", "grpolab", "grpo", "--n-grpo-steps", "1", "--run-dir",
                           str(tmp_path / "run")], preexec_fn=limit, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    if done.returncode == 0:
        pytest.skip("this machine starts grpolab within 300 MB of address space: nothing to refuse")
    if done.stderr.strip().splitlines()[-1].startswith("OpenBLAS error"):  # its C code exits before Python can speak
        pytest.skip("OpenBLAS (numpy's) exits on its own buffer allocation here, before any Python error")
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "grpolab: error: out of memory (the address-space limit (ulimit -v) is 0.29 GiB"), done.stderr[-2000:]
