"""The embedded tasks' ``task_options``: a ``seed`` among them wins over the run's (grpo, eval, DPO
pairs alike), and an unknown option, one of the wrong type or out of range is one line naming the
task and the option (reasoning-gym's are in test_gym_tasks.py)."""

from __future__ import annotations

import pytest

from grpolab.data import get_task
from grpolab.training.inputs import load_inputs, task_or_file, task_preference_pairs


def _questions(examples) -> list[str]:
    return [e.question for e in examples]


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "retrieval"])
def test_a_seed_in_task_options_wins_over_the_runs(name):
    options = {"num_entities": 40} if name == "retrieval" else {}
    given = get_task(name, seed=1, options={**options, "seed": 5})
    assert given.seed == 5
    assert _questions(given.examples("test", 3)) == _questions(get_task(name, seed=5, **options).examples("test", 3))
    assert _questions(get_task(name, seed=1, **options).examples("test", 3)) != _questions(given.examples("test", 3))


def test_the_run_paths_take_a_seed_in_task_options(grpo_config):
    from grpolab.data.prompts import load_template

    expected = _questions(get_task("arithmetic", seed=5, digits=1).examples("train", 4))
    cfg = grpo_config(task="arithmetic", task_options={"digits": 1, "seed": 5}, seed=2, task_train_size=4)
    assert _questions(load_inputs(cfg).train) == expected  # grpo, sft, ppo, ei
    examples, _, _ = task_or_file("task:arithmetic", 4, seed=2, split="train", task_options={"digits": 1, "seed": 5})
    assert _questions(examples) == expected  # eval, compare
    template = load_template("compact")
    pairs = task_preference_pairs("arithmetic", "train", 4, 2, {"digits": 1, "seed": 5}, template)
    assert [p.prompt for p in pairs] == [template.format(q) for q in expected]  # dpo


@pytest.mark.parametrize("name,options,says", [
    ("arithmetic", {"digitz": 2}, "unknown option 'digitz'; its options are: seed, wrong_fraction"),
    ("arithmetic", {"digits": "two"}, "digits must be an integer, got 'two'"),
    ("arithmetic", {"digits": 2.5}, "digits must be an integer, got 2.5"),
    ("arithmetic", {"digits": True}, "digits must be an integer, got True"),
    ("arithmetic", {"digits": 0}, "digits must be at least 1, got 0"),
    ("arithmetic", {"num_ops": -5}, "num_ops must be at least 1, got -5"),
    ("arithmetic", {"digits": 10**6}, "digits must be at most 40"),
    # T03: 100 products of 100-digit numbers would pass Python's 4300-digit int-to-str limit
    ("arithmetic", {"digits": 100, "num_ops": 100, "ops": "*"}, "digits must be at most 40, got 100"),
    ("arithmetic", {"num_ops": 101}, "num_ops must be at most 100, got 101"),
    # T02: a huge integer is compared exactly, never converted to a float (OverflowError)
    ("arithmetic", {"wrong_fraction": 10**400}, "wrong_fraction must be a finite number, got an integer of 401 digits"),
    ("arithmetic", {"wrong_fraction": 10**300}, "wrong_fraction must be at most 1.0, got an integer of 301 digits"),
    ("arithmetic", {"seed": 2**64}, "seed must be at most 9223372036854775807"),
    ("countdown", {"seed": -(2**64)}, "seed must be at least -9223372036854775807"),
    ("arithmetic", {"ops": "/"}, "ops must be one or more of '+-*'"),
    ("arithmetic", {"ops": 5}, "ops must be a string, got 5"),
    ("arithmetic", {"phrasing": "prose"}, "phrasing must be one of 'compact', 'words'"),
    ("arithmetic", {"wrong_fraction": float("nan")}, "wrong_fraction must be a finite number"),
    ("arithmetic", {"wrong_fraction": 1.5}, "wrong_fraction must be at most 1.0, got 1.5"),
    ("arithmetic", {"wrong_kind": "typo"}, "wrong_kind must be one of 'step', 'answer'"),
    ("arithmetic", {"seed": "x"}, "seed must be an integer, got 'x'"),
    ("arithmetic", {"reward_fn": print}, "unknown option 'reward_fn'"),
    ("countdown", {"num_numbers": 2.5}, "num_numbers must be an integer, got 2.5"),
    ("countdown", {"max_number": -3}, "max_number must be at least 2, got -3"),
    ("retrieval", {"num_entities": "x"}, "num_entities must be an integer, got 'x'"),
    ("retrieval", {"num_entities": 0}, "num_entities must be at least 10, got 0"),
    ("retrieval", {"wrong_kind": "step"}, "wrong_kind must be one of 'answer', 'typo'"),
    ("retrieval", {"relations": "weather"}, "relations must be a comma-separated list of ruler"),
])
def test_a_wrong_option_is_one_line_naming_the_task_and_the_option(name, options, says):
    with pytest.raises(ValueError) as err:
        get_task(name, options=options)
    message = str(err.value)
    assert message.startswith(f"task_options of {name}: ") and says in message and "\n" not in message, message


def test_yaml_anchors_in_task_options_are_one_line(grpo_config):
    # Y05: anchors that add keys (a0, ...) the task does not have
    with pytest.raises(ValueError, match=r"^task_options of arithmetic: unknown option 'a0'"):
        load_inputs(grpo_config(task="arithmetic", task_options={"a0": [1, 2], "digits": 1}))


def test_eval_with_a_wrong_embedded_task_option_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from grpolab import cli

    out = CliRunner().invoke(cli.app, ["eval", "--model", "embedded:tiny", "--data", "task:arithmetic",
                                       "--task-option", "digitz=2", "--out", str(tmp_path / "eval")])
    lines = out.stderr.strip().splitlines()
    assert out.exit_code == 2 and len(lines) == 1 and "unknown option 'digitz'" in lines[0], out.stderr


def test_an_integer_option_without_its_own_bound_is_at_most_max_integer():
    # T05: a reasoning-gym `size: 2**63` overflowed inside the generator; every integer option has a bound
    from grpolab.data.tasks.options import MAX_INTEGER, check_options

    fields = {"size": int, "limit": int | None, "ratio": float}
    where = "^task_options of rg:x: "
    with pytest.raises(ValueError, match=where + "size must be at most 1000000000, got 9223372036854775808$"):
        check_options("rg:x", {"size": 2**63}, fields, {"size": (1, None)})
    with pytest.raises(ValueError, match=where + "limit must be at least -1000000000, got "):
        check_options("rg:x", {"limit": -(10**12)}, fields)
    with pytest.raises(ValueError, match=where + "ratio must be a finite number, got an integer of 401 digits$"):
        check_options("rg:x", {"ratio": 10**400}, fields)
    check_options("rg:x", {"size": MAX_INTEGER, "limit": None, "ratio": 10**300}, fields, {"size": (1, None)})
