"""The command line as a user meets it, through real subprocesses: ``python -m grpolab`` is the
``grpolab`` command, and a refused input is one line on stderr (``grpolab: error: ...``, exit 2, no
traceback), given before anything is written or sampled.

Most of a refused command's time is Python start-up, so the refused commands all start together
(``refused`` below) and each test reads its own result.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TIMEOUT = 240  # a hang guard only
CONSOLE_SCRIPT = Path(sys.executable).with_name("grpolab")


def grpolab(*args) -> list[str]:
    return [sys.executable, "-m", "grpolab", *map(str, args)]


# ---------------------------------------------------------------- python -m grpolab


@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason=f"no console script at {CONSOLE_SCRIPT} (pip install -e .)")
@pytest.mark.parametrize("args", [["--help"], ["grpo", "--help"], ["eval", "--help"]], ids=" ".join)
def test_python_m_grpolab_is_the_grpolab_command(args):
    as_module = subprocess.run(grpolab(*args), check=False, capture_output=True, text=True, cwd=ROOT, env=ENV,
                               timeout=TIMEOUT)
    as_script = subprocess.run([str(CONSOLE_SCRIPT), *args], check=False, capture_output=True, text=True, cwd=ROOT,
                               env=ENV, timeout=TIMEOUT)
    assert as_module.returncode == as_script.returncode == 0, as_module.stderr + as_script.stderr
    assert as_module.stdout == as_script.stdout
    assert as_module.stderr == as_script.stderr == ""
    assert "Usage: grpolab " in as_module.stdout
    if args == ["--help"]:
        for command in ("grpo", "sft", "ei", "ppo", "dpo", "eval", "compare", "demo"):
            assert command in as_module.stdout


# ---------------------------------------------------------------- refused inputs


def _cases(tmp: Path) -> dict[str, list[str]]:
    a_file = tmp / "a_file.txt"
    a_file.write_text("not a directory\n")
    return {
        # greedy sampling makes every response of a group identical: every advantage would be 0
        "greedy_groups": grpolab("grpo", "--sampling-temperature", "0", "--group-size", "4", "--device", "cpu",
                                 "--run-dir", tmp / "greedy_run"),
        # k1 = log(pi/ref) has zero expected gradient as a loss term: it would regularise nothing
        "k1_kl_loss": grpolab("grpo", "--kl-estimator", "k1", "--kl-coef", "0.1", "--device", "cpu",
                              "--run-dir", tmp / "k1_run"),
        "eval_n_0": grpolab("eval", "--model", "embedded:tiny", "--data", "task:arithmetic", "--n", "0",
                            "--out", tmp / "eval_n_0"),
        # --out checked before anything is loaded: with a model path that does not exist, the
        # error is still the --out one ...
        "eval_out_file_bad_model": grpolab("eval", "--model", tmp / "no_such_model", "--data", "task:arithmetic",
                                           "--n", "2", "--out", a_file),
        # ... and with a real model and an evaluation that would sample for hours, it comes at once
        "eval_out_file_huge_eval": grpolab("eval", "--model", "embedded:tiny", "--data", "task:arithmetic",
                                           "--n", "100000", "--k", "64", "--max-tokens", "1024", "--out", a_file),
        # a reasoning-gym name that does not exist (or reasoning-gym missing): one line, nothing made
        "rg_unknown": grpolab("grpo", "--task", "rg:no_such_generator", "--device", "cpu", "--run-dir", tmp / "rg_run"),
        # a reward model that is not a model directory: refused by the config, before anything loads
        "rm_not_a_model": grpolab("grpo", "--reward", f"{{model: {tmp / 'no_rm'}}}", "--device", "cpu",
                                  "--run-dir", tmp / "rm_run"),
        # compare --variants on a model directory that does not exist, and --data without --variants
        "variants_bad_model": grpolab("compare", "--variants", "grpo", "--model", tmp / "no_such_model",
                                      "--run-dir", tmp / "variants_run"),
        "compare_data_without_variants": grpolab("compare", "--data", "rg:basic_arithmetic", "--run-dir",
                                                 tmp / "compare_run"),
        "demo_dtype": grpolab("demo", "--dtype", "float16", "--run-dir", tmp / "demo_run"),
        "variants_no_tests": grpolab("compare", "--variants", "grpo", "--test-examples", "0", "--run-dir",
                                     tmp / "variants_run"),
    }


class Finished:
    def __init__(self, argv, returncode: int, stdout: str, stderr: str, wall_s: float):
        self.argv, self.returncode, self.stdout, self.stderr, self.wall_s = argv, returncode, stdout, stderr, wall_s


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every refused command, started together; name -> (its finished process, its scratch dir)."""
    tmp = tmp_path_factory.mktemp("refused")
    cases = _cases(tmp)
    logs = {name: (open(tmp / f"{name}.out", "w+"), open(tmp / f"{name}.err", "w+"))  # noqa: SIM115 - closed below
            for name in cases}
    started = time.monotonic()
    procs = {name: subprocess.Popen(argv, stdout=logs[name][0], stderr=logs[name][1], stdin=subprocess.DEVNULL,
                                    cwd=ROOT, env=ENV) for name, argv in cases.items()}
    out = {}
    try:
        for name, proc in procs.items():
            returncode = proc.wait(TIMEOUT)
            wall = time.monotonic() - started
            streams = []
            for f in logs[name]:
                f.seek(0)
                streams.append(f.read())
                f.close()
            out[name] = Finished(cases[name], returncode, *streams, wall)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out, tmp


def assert_one_line_error(result: Finished, *needles: str) -> str:
    lines = result.stderr.strip("\n").splitlines()
    assert result.returncode == 2, f"exit {result.returncode}, stderr:\n{result.stderr[-4000:]}"
    assert len(lines) == 1 and lines[0].startswith("grpolab: error: "), f"not one error line:\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_greedy_sampling_with_groups_is_refused_in_one_line(refused):
    results, tmp = refused
    assert_one_line_error(results["greedy_groups"], "sampling_temperature 0", "group_size 4")
    assert not (tmp / "greedy_run").exists(), "a refused config created its run directory"


def test_k1_kl_estimator_as_a_loss_is_refused_in_one_line(refused):
    results, tmp = refused
    assert_one_line_error(results["k1_kl_loss"], "k1", "zero expected gradient")
    assert not (tmp / "k1_run").exists(), "a refused config created its run directory"


def test_an_unknown_reasoning_gym_task_is_refused_in_one_line(refused):
    results, tmp = refused
    assert_one_line_error(results["rg_unknown"], "reasoning-gym")  # the available names, or the extra to install
    assert not (tmp / "rg_run").exists()


def test_a_reward_model_that_is_not_a_directory_is_refused_in_one_line(refused):
    results, tmp = refused
    assert_one_line_error(results["rm_not_a_model"], "reward.model", "no config.json")
    assert not (tmp / "rm_run").exists()


def test_compare_model_and_data_are_refused_in_one_line_where_they_cannot_apply(refused):
    results, tmp = refused
    assert_one_line_error(results["variants_bad_model"], "model directory not found", "no_such_model")
    assert_one_line_error(results["compare_data_without_variants"], "--model and --data apply to --variants")
    assert_one_line_error(results["variants_no_tests"], "--test-examples must be at least 1")
    assert not (tmp / "variants_run").exists() and not (tmp / "compare_run").exists()


def test_a_demo_dtype_other_than_float32_or_bfloat16_is_refused_in_one_line(refused):
    results, tmp = refused
    assert_one_line_error(results["demo_dtype"], "--dtype must be float32 or bfloat16", "float16")
    assert not (tmp / "demo_run").exists()


def test_eval_n_0_is_refused_in_one_line(refused):
    results, tmp = refused
    assert_one_line_error(results["eval_n_0"], "--n")
    assert not (tmp / "eval_n_0").exists()


def test_eval_out_that_is_a_file_is_refused_before_loading_or_sampling(refused):
    results, tmp = refused
    a_file = tmp / "a_file.txt"
    for name in ("eval_out_file_bad_model", "eval_out_file_huge_eval"):
        assert_one_line_error(results[name], str(a_file), "is a file")
    assert a_file.read_text() == "not a directory\n"
    # 6.4M sampled responses would take hours: the refusal came before any of them (one line on
    # stderr: the plan line printed before sampling is absent)
