"""Options documented where they are declared (issue 33): every field of every training command's
config has a description (the docstring under it), ``grpolab <command> --help`` lists every field
without importing a method module, ``grpolab config <command>`` prints YAML that loads back to the
same config, and the generated pages (``docs/reference/config.md``, ``cli.md``) and the fields'
snapshot are current."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from grpolab.algorithms import METHODS
from tests.helpers.cli_help import help_and_imports

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python -m grpolab.cli.reference"
MAX_DESCRIPTION = 250  # one or two lines


def _config(command: str):
    return METHODS[command].load()[0]


def _grpolab(*args: str, process: bool = False) -> subprocess.CompletedProcess:
    """``grpolab ARGS``: in this process (typer's runner, through ``main``'s flag handling), or as a
    real ``python -m grpolab`` process with ``process``."""
    if process:
        return subprocess.run([sys.executable, "-m", "grpolab", *args], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=300)
    from typer.testing import CliRunner

    from grpolab.cli import app, boolean_flag_values

    result = CliRunner().invoke(app, boolean_flag_values(list(args)), prog_name="grpolab")
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


@pytest.mark.parametrize("command", list(METHODS))
def test_every_field_of_every_config_has_a_short_description(command):
    fields = _config(command).model_fields
    missing = [name for name, field in fields.items() if not (field.description or "").strip()]
    assert not missing, f"{command}: fields without a docstring under them: {', '.join(missing)}"
    long = [name for name, field in fields.items() if len(" ".join(field.description.split())) > MAX_DESCRIPTION]
    assert not long, f"{command}: descriptions over {MAX_DESCRIPTION} characters (one or two lines): {long}"


def test_help_lists_every_field_of_every_training_command():
    from grpolab.cli.reference import help_text

    for command in METHODS:
        text = help_text([command, "--help"])
        options = {line.split()[1] for line in text.splitlines() if line.startswith("│ --")}
        expected = {"--" + name.replace("_", "-") for name in _config(command).model_fields}
        assert expected <= options, f"{command} --help lacks {sorted(expected - options)}"
        assert {"--config", "--resume", "--overwrite"} <= options  # typer's own options stay
        assert max(len(line) for line in text.splitlines()) <= 80


def test_help_shows_the_type_default_and_description_of_a_field():
    from grpolab.cli.reference import help_text

    text = help_text(["ppo", "--help"])
    assert "│ --kl-coef float (>= 0)  [default: 0.2]" in text  # PPO's own default (method_defaults)
    assert "│ --run-dir str  [default: runs/ppo]" in text  # re-declared: its description is the base's
    assert "│   Where the run writes config.yaml" in text
    assert "╭─ PPO: value function and GAE" in text


def test_grpo_help_imports_no_method_module_and_no_torch():
    text, imported = help_and_imports("grpo", "grpolab.algorithms.")
    assert "--n-grpo-steps" in text and imported == []


def test_an_edited_class_is_described_from_its_source_not_from_a_stale_snapshot(tmp_path, monkeypatch):
    from grpolab.cli import fields

    data = json.loads(fields.SNAPSHOT.read_text(encoding="utf-8"))
    key = next(k for k in data["classes"] if k.endswith(":GRPOConfig"))
    data["classes"][key]["hash"] = "0" * 16  # as if GRPOConfig were edited since the snapshot
    data["classes"][key]["fields"][0]["description"] = "stale"
    stale = tmp_path / "fields.json"
    stale.write_text(json.dumps(data), encoding="utf-8")
    monkeypatch.setattr(fields, "SNAPSHOT", stale)
    assert fields.command_fields("grpo") == fields.describe(_config("grpo"))
    monkeypatch.setattr(fields, "SNAPSHOT", tmp_path / "missing.json")
    assert fields.command_fields("sft") == fields.describe(_config("sft"))


def test_the_generated_pages_and_the_snapshot_are_current():
    from grpolab.cli import reference

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference.outputs()
    drawn_by = re.search(r"--help, (typer [^,]+, rich [^)]+)\)", reference.CLI_PAGE.read_text(encoding="utf-8"))
    if drawn_by and drawn_by.group(1) != reference.renderer():  # another typer/rich draws the boxes differently
        expected.pop(reference.CLI_PAGE)
    stale = reference.stale(expected)
    assert not stale, f"stale: {', '.join(str(p.relative_to(ROOT)) for p in stale)}; regenerate with {REGENERATE}"
    if reference.CLI_PAGE not in expected:
        pytest.skip(f"cli.md was drawn by {drawn_by.group(1)}, not {reference.renderer()}: only config.md checked")


def test_the_config_page_has_every_field_once_per_class_that_declares_it():
    text = (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    for command in METHODS:
        for name in _config(command).model_fields:
            assert f"| `{name}` |" in text, f"{name} ({command}) is not in docs/reference/config.md"
    assert text.count("| `model` |") == 1  # a shared field is shown once


@pytest.mark.parametrize("command", list(METHODS))
def test_config_output_loads_back_to_the_same_config(command, tmp_path):
    from grpolab.cli.config import render_yaml

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = _config(command)()
        path = tmp_path / "printed.yaml"
        path.write_text(render_yaml(cfg, command), encoding="utf-8")
        assert _config(command).build(path) == cfg


def test_config_output_keeps_values_that_yaml_could_misread(tmp_path):
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.cli.config import render_yaml

    cfg = GRPOConfig.build(None, {
        "system_prompt": "Answer: yes\n# not a comment\n  indented: 1\n", "stop": ["</answer>", "null", "a: b"],
        "reward": [{"fn": "r1_zero", "weight": 0.5}, {"fn": "tests.helpers.reward_fixtures:length_parity"}],
        "betas": [0.8, 0.99], "learning_rate": 3e-7, "train_data": "data/gsm8k.jsonl", "threads": 1,
        "stop_on_unhealthy": ["truncation", "format"], "env": {"tools": ["calculate"], "max_turns": 2}})
    path = tmp_path / "printed.yaml"
    path.write_text(render_yaml(cfg, "grpo"), encoding="utf-8")
    assert GRPOConfig.build(path) == cfg
    assert cfg.task is None and "task: null" in path.read_text(encoding="utf-8")


def test_grpolab_config_prints_commented_yaml_with_the_overrides_applied(tmp_path):
    from grpolab.algorithms.sft import SFTConfig

    start = tmp_path / "start.yaml"
    start.write_text("n_sft_steps: 7\nseed: 3\n", encoding="utf-8")
    proc = _grpolab("config", "sft", "--config", str(start), "--seed", "5", "--append-eos", "false")
    assert proc.returncode == 0, proc.stderr
    assert "# Optimizer steps (the run's length).\nn_sft_steps: 7\n" in proc.stdout
    printed = tmp_path / "printed.yaml"
    printed.write_text(proc.stdout, encoding="utf-8")
    assert SFTConfig.build(printed) == SFTConfig.build(start, {"seed": 5, "append_eos": False})


@pytest.mark.parametrize("args,message", [
    (("config", "sftt"), "unknown command 'sftt'; expected one of grpo, sft, ei, ppo, dpo, rm"),
    (("config", "grpo", "--group-sise", "3"), "unknown key 'group_sise' (command line)"),
    (("config", "grpo", "--group-size", "3"), "rollout_batch_size (256) must be divisible by group_size (3)"),
    (("config", "dpo", "--config", "/nonexistent.yaml"), "/nonexistent.yaml: no such config file"),
])
def test_grpolab_config_errors_are_one_line(args, message):
    proc = _grpolab(*args, process=args[1] == "sftt")  # one end to end: the rest in this process (seconds each)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("grpolab: error: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
