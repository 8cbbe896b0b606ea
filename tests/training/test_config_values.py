"""Config values as given: a command-line value reaches a text field exactly as typed and is read
as YAML only for a field whose type needs it; a config file is read by a safe loader (no duplicate
keys, no alias bomb, a size limit, its name on a decoding error); no NaN or inf in a float field; a
refused value is shown in a bounded repr; an update that makes the weights non-finite stops the run
before a checkpoint is written."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpolab.rewards import check_reward_output
from grpolab.training.config import ConfigError, parse_overrides, short_repr
from grpolab.training.optimization import nonfinite_parameters
from grpolab.training.sampled_run_config import PolicyUpdateConfig

ROOT = Path(__file__).resolve().parents[2]
BATCHES = {"rollout_batch_size": 8, "group_size": 4, "train_batch_size": 8, "gradient_accumulation_steps": 1}
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def build(*args: str, path=None) -> PolicyUpdateConfig:
    return PolicyUpdateConfig.build(path, {**BATCHES, **parse_overrides(list(args))})


# ---------------------------------------------------------------- command-line values


@pytest.mark.parametrize("field, text", [
    ("system_prompt", "You are a calculator #1 rule: be brief"),  # Y09: YAML cut it at ' #'
    ("system_prompt", "Rule: answer with a number"),  # Y10: YAML read a mapping
    ("run_dir", "runs/exp #2"),  # Y08
    ("run_dir", "runs/with space\nand newline"),  # Y07: YAML folded the newline
    ("task", "rg:"),  # RG02: YAML read {'rg': None}
    ("prompt_template", "  padded '{question}'  "),
    ("model", "yes"),  # YAML 1.1 would read true
    ("data_format", "jsonl"),
])
def test_a_text_field_takes_the_value_as_typed(field, text):
    value = PolicyUpdateConfig._override(field, parse_overrides([f"--{field.replace('_', '-')}", text])[field])
    assert value == text and type(value) is str


def test_the_training_commands_see_the_text_whole():
    cfg = build("--system-prompt", "You are a calculator #1 rule: be brief", "--run-dir", "runs/exp #2")
    assert (cfg.system_prompt, cfg.run_dir) == ("You are a calculator #1 rule: be brief", "runs/exp #2")
    assert build("--task", "rg:").task == "rg:"  # the task's loader names what is wrong with it, not YAML


def test_null_is_none_for_a_field_that_may_be_null():
    cfg = build("--system-prompt", "null", "--prompt-template", "~", "--max-grad-norm", "null", "--kl-stop", "")
    assert (cfg.system_prompt, cfg.prompt_template, cfg.max_grad_norm, cfg.kl_stop) == (None, None, None, None)
    assert build("--run-dir", "null").run_dir == "null"  # a text field that cannot be null keeps the text


def test_other_fields_still_read_yaml():
    cfg = build("--seed", "3", "--betas", "[0.8, 0.9]", "--task-options", "{digits: 2}", "--stop", "[a, b]",
                "--show-progress", "false", "--deterministic", "--lora-target-modules", "[q_proj, v_proj]",
                "--reward", "[{fn: r1_zero, weight: 0.5}]", "--learning-rate", "3e-4")
    assert (cfg.seed, cfg.betas, cfg.task_options, cfg.stop) == (3, (0.8, 0.9), {"digits": 2}, ["a", "b"])
    assert (cfg.show_progress, cfg.deterministic, cfg.lora_target_modules) == (False, True, ["q_proj", "v_proj"])
    assert cfg.reward == [{"fn": "r1_zero", "weight": 0.5}] and cfg.learning_rate == 3e-4
    assert build("--lora-target-modules", "q_proj #x").lora_target_modules == "q_proj #x"
    assert build("--reward", "r1_zero").reward == "r1_zero"


def test_a_refused_command_line_value_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match=r"^command line: 'seed': .* \(got 'abc #x'\)$"):
        build("--seed", "abc #x")
    config = tmp_path / "c.yaml"
    config.write_text("seed: [1]\n")
    with pytest.raises(ConfigError, match=r"c.yaml: 'seed': .*; 'group_size' \(command line\): "):
        build("--group-size", "x", path=config)


# ---------------------------------------------------------------- config files


def test_a_duplicate_key_is_refused_naming_its_line(tmp_path):  # Y01
    config = tmp_path / "dup.yaml"
    config.write_text("learning_rate: 0.5\ngroup_size: 4\nlearning_rate: 1.0e-4\n")
    with pytest.raises(ConfigError, match=r"dup.yaml:3: .*duplicate key 'learning_rate' \(first at line 1\)"):
        PolicyUpdateConfig.build(config)
    nested = tmp_path / "nested.yaml"
    nested.write_text("task_options:\n  digits: 1\n  digits: 2\n")
    with pytest.raises(ConfigError, match=r"nested.yaml:3: .*duplicate key 'digits'"):
        PolicyUpdateConfig.build(nested)
    merged = tmp_path / "merge.yaml"  # a key beside a merge key overrides the merged one, as YAML says
    merged.write_text("task_options: {<<: {digits: 1, num_ops: 2}, digits: 2}\n")
    assert PolicyUpdateConfig.build(merged, BATCHES).task_options == {"digits": 2, "num_ops": 2}


def test_a_config_that_is_not_utf8_or_too_big_names_the_file(tmp_path):  # Y11
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"seed: 1\nrun_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text \(byte 0xe9"):
        PolicyUpdateConfig.build(bad)
    with pytest.raises(ConfigError, match=r": is a directory"):
        PolicyUpdateConfig.build(tmp_path)
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(11 * 2**20)  # sparse: nothing is written
    with pytest.raises(ConfigError, match=r"big.yaml: 11534336 bytes, larger than a config may be"):
        PolicyUpdateConfig.build(big)


BOMB = "\n".join(["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
                 + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
                 + ["group_size: *a9"]) + "\n"

# the checks run in a child under a 2 GB address-space limit, so that a regression fails instead of
# taking the machine's memory
BOMB_CHILD = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
    from grpolab.training.config import ConfigError
    from grpolab.training.sampled_run_config import PolicyUpdateConfig
    shared = ["lol"] * 9
    for _ in range(9):
        shared = [shared] * 9  # 9^10 leaves once expanded, 90 lists in memory
    for path, overrides in ((sys.argv[1], None), (None, {"group_size": shared})):
        start = time.perf_counter()
        try:
            PolicyUpdateConfig.build(path, overrides)
        except ConfigError as exc:
            print(f"{time.perf_counter() - start:.2f}s {exc}")
""")


def test_an_alias_bomb_is_refused_quickly_in_one_line(tmp_path):  # Y02
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    assert len(BOMB) < 1000
    done = subprocess.run([sys.executable, "-c", BOMB_CHILD, str(bomb)], capture_output=True, text=True, env=ENV,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    from_file, from_code = done.stdout.splitlines()
    assert from_file.endswith("bomb.yaml: invalid YAML (aliases expand it by 8335593937 values, more than 100000: "
                              "a YAML alias bomb?)")
    assert "'group_size': Input should be a valid integer (got [[[" in from_code and len(from_code) < 300
    assert all(float(line.split("s ", 1)[0]) < 5 for line in (from_file, from_code))


def test_a_refused_value_is_shown_short():
    assert len(short_repr("x" * 10**6)) <= 100
    assert short_repr([1, 2]) == "[1, 2]"


# ---------------------------------------------------------------- NaN and inf


@pytest.mark.parametrize("args", [["--learning-rate", ".inf"], ["--sampling-temperature", "nan"],
                                  ["--kl-coef", "-.inf"], ["--betas", "[0.9, .nan]"], ["--max-grad-norm", ".nan"]])
def test_no_float_field_takes_nan_or_inf(args):  # Y12
    key = args[0][2:].replace("-", "_")
    with pytest.raises(ConfigError, match=rf"^command line: '{key}(\.1)?': Input should be a finite number"):
        build(*args)
    with pytest.raises(ConfigError, match="finite number"):
        PolicyUpdateConfig.build(None, {**BATCHES, "learning_rate": math.inf})


def test_a_reward_weight_must_be_finite(tmp_path):  # RM05
    with pytest.raises(ConfigError, match=r"reward\[0\]\.weight: Input should be a finite number"):
        build("--reward", "[{fn: r1_zero, weight: .nan}]")
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    with pytest.raises(ConfigError, match=r"reward\.weight: Input should be a finite number"):
        build("--reward", f"{{model: {tmp_path}, weight: .nan}}")


def test_a_reward_beyond_float32_is_a_reward_error():  # RM17: finite in float64, inf as a float32 tensor
    assert check_reward_output({"reward": 3e38}) == {"reward": 3e38}
    with pytest.raises(ValueError, match=r"reward=1e\+39, outside float32's range"):
        check_reward_output({"reward": 1e39})


def test_nonfinite_parameters_counts_the_tensors_with_nan_or_inf():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    bad, total = nonfinite_parameters(optimizer)
    assert (bad, total) == (0, 4)
    with torch.no_grad():
        model[0].weight[1, 2] = math.nan
        model[1].bias[0] = -math.inf
        model[1].weight.fill_(3e38)  # large but finite: its sum overflows, its values do not
    assert nonfinite_parameters(optimizer) == (2, 4)


def tiny_grpo_config(tmp_path) -> Path:
    config = tmp_path / "g.yaml"
    config.write_text(textwrap.dedent(f"""\
        model: embedded:tiny
        task_options: {{digits: 1}}
        task_train_size: 8
        n_grpo_steps: 2
        rollout_batch_size: 8
        group_size: 4
        train_batch_size: 8
        gradient_accumulation_steps: 1
        sampling_max_tokens: 6
        sampling_min_tokens: 1
        eval_examples: 1
        checkpoint_every: 1
        warmup_steps: 0
        device: cpu
        threads: 1
        show_progress: false
        token_record_groups: 0
        run_dir: {tmp_path / "run"}
        """))
    return config


def test_an_update_that_breaks_the_weights_stops_the_run_before_a_checkpoint(tmp_path):  # Y12
    config = tiny_grpo_config(tmp_path)
    # valid, finite values (within float32 too), whose update overflows float32: the weight decay scales
    # the norms' weights (1.0) by 1 - 3.3e38, and the Adam step (~3e37) pushes half of them past 3.4e38
    done = subprocess.run([sys.executable, "-m", "grpolab", "grpo", "-c", str(config), "--learning-rate", "3e37",
                           "--weight-decay", "11"],
                          capture_output=True, text=True, env=ENV, timeout=240, check=False, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert any(re.fullmatch(r"grpolab: error: optimizer step \d+: \d+ of 47 parameter tensors hold NaN or inf after "
                            r"the update .*stopped before any checkpoint of them is written.*", line)
               for line in lines), done.stderr[-3000:]
    assert not (tmp_path / "run" / "final").exists()
    for saved in (tmp_path / "run" / "checkpoints").glob("step_*/model.safetensors"):  # earlier steps: finite
        assert all(torch.isfinite(t).all() for t in load_file(saved).values()), saved


RANKS_CHILD = textwrap.dedent("""
    import os, sys
    from types import SimpleNamespace
    import torch
    from grpolab.training import distributed
    from grpolab.training.health import NonFiniteWeightsError
    from grpolab.training.run import Run

    rank = int(sys.argv[1])
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=sys.argv[2])
    dist = distributed.setup("ddp", torch.device("cpu"))
    model = torch.nn.Linear(4, 4)
    if rank == 1:  # a shard (FSDP2) or a replica gone wrong on one rank only
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    run = SimpleNamespace(dist=dist, device=torch.device("cpu"), train_step=7, cfg=SimpleNamespace(learning_rate=1.0),
                          _nonfinite_at_start=0)  # the weights were finite before the first step
    run._nonfinite_tensors = lambda optimizer: Run._nonfinite_tensors(run, optimizer)
    try:
        Run._check_weights(run, torch.optim.AdamW(model.parameters()))
        print(f"rank {rank} went on")
    except NonFiniteWeightsError as exc:
        print(f"rank {rank} stopped: {exc}")
    distributed.teardown(barrier=False)
""")


def test_every_rank_stops_when_one_ranks_weights_are_not_finite(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_CHILD)
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    for rank, (out, err) in enumerate(outputs):
        assert out.startswith(f"rank {rank} stopped: optimizer step 7: 1 of 2 parameter tensors hold NaN"), err[-2000:]


def test_a_float_beyond_float32s_range_is_refused_naming_the_field():
    """Finite in Python, infinite in every float32 tensor it meets: AdamW would fail deep in its step."""
    from grpolab.algorithms.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=r"'learning_rate': 1e\+39 holds a number beyond float32's range"):
        GRPOConfig.build(None, {"learning_rate": 1e39})
    assert GRPOConfig.build(None, {"learning_rate": 3e38}).learning_rate == 3e38
    for deep in ({"reward": [{"fn": "r1_zero", "weight": 1.0e39}]}, {"task_options": {"rate": [1e39]}}):  # deep too
        with pytest.raises(ConfigError, match=f"'{next(iter(deep))}'.* holds a number beyond float32's range"):
            GRPOConfig.build(None, deep)


@pytest.mark.parametrize("args, refused", [
    (["--max-grad-norm", "-1"], "'max_grad_norm': Input should be greater than or equal to 0"),  # would ascend
    (["--normalize-constant", "-1"], "'normalize_constant': Input should be greater than 0"),  # would ascend too
    (["--normalize-constant", "0"], "'normalize_constant': Input should be greater than 0"),  # was read as null
    (["--betas", "[0.9, 2]"], "'betas.1': Input should be less than 1"),  # AdamW refused it only after --overwrite
    (["--run-dir", ""], "'run_dir': must not be empty"),  # was the current directory
    (["--model="], "'model': must not be empty"),
    (["--device", "meta"], "'device': 'meta' is not a device the trainers run on"),
    (["--seed", "-1"], "'seed': Input should be greater than or equal to 0"),
    (["--seed", str(10**23)], "'seed': Input should be less than"),  # was an overflow deep in torch
    (["--seed", "0b11"], "'seed': Input should be a valid integer"),  # YAML 1.1 read these as 3, 90, 1
    (["--eval-every", "1:30"], "'eval_every': Input should be a valid integer"),
    (["--seed", "true"], "'seed': Input should be a valid integer"),
])
def test_values_that_would_run_wrong_are_refused_naming_the_field(args, refused):
    from grpolab.algorithms.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=re.escape(f"command line: {refused}")):
        GRPOConfig.build(None, parse_overrides(args))


def test_integers_on_the_command_line_are_decimal():
    from grpolab.algorithms.grpo import GRPOConfig

    assert GRPOConfig.build(None, parse_overrides(["--seed", "010", "--eval-every", "+5"])).seed == 10


def test_a_key_that_is_not_a_name_and_a_nul_byte_are_one_line(tmp_path):
    (tmp_path / "k.yaml").write_text("seed: 1\n~: 2\n")
    with pytest.raises(ConfigError, match=r"k.yaml: key None is not a name"):
        PolicyUpdateConfig.build(tmp_path / "k.yaml")
    (tmp_path / "nul.yaml").write_text("seed: 1\x00\n")
    with pytest.raises(ConfigError) as refused:
        PolicyUpdateConfig.build(tmp_path / "nul.yaml")
    assert "\n" not in str(refused.value) and "nul.yaml: invalid YAML (unacceptable character" in str(refused.value)


def test_an_update_that_overflows_adamw_is_one_line_before_a_checkpoint(tmp_path):
    """lr 3e38 is within float32, but Adam's first step is lr / (1 - beta1): torch refuses it deep in AdamW."""
    done = subprocess.run([sys.executable, "-m", "grpolab", "grpo", "-c", str(tiny_grpo_config(tmp_path)),
                           "--learning-rate", "3e38"], capture_output=True, text=True, env=ENV, timeout=240,
                          check=False, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    # torch's for-each AdamW refuses the step; the fused kernel applies it, and the weight check then stops the run
    assert re.search(r"grpolab: error: optimizer step 0: (AdamW's update overflows float32|\d+ of \d+ parameter "
                     r"tensors hold NaN or inf after the update) \(learning_rate 3e\+38\)", done.stderr), done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2, done.stderr  # the dtype line and the error
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_comment_sign_alone_is_a_value_and_a_negative_margin_is_refused():
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.algorithms.rm import RMConfig

    # a bare text for a list field is a list of one: '#' is kept as the stop string, not read as a YAML comment
    assert GRPOConfig.build(None, parse_overrides(["--stop", "#"])).stop == ["#"]
    with pytest.raises(ConfigError, match=r"'margin': Input should be greater than or equal to 0"):
        RMConfig.build(None, parse_overrides(["--margin", "-1"]))
