"""The options of ``grpolab eval``, ``compare`` and ``demo`` are validated configs (``grpolab.cli.options``):
the commands' parameters are their fields, their flags, defaults and help texts the fields' own (one source,
read at start-up from the snapshot ``fields.json`` without importing the options' module); every field is
described; a rule an option shares with a training config is that config's own; a refusal is one line
naming the flag."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import typer

from grpolab.cli import app
from grpolab.cli.options import CompareOptions, DemoOptions, EvalOptions
from grpolab.training.config import ConfigError
from tests.helpers.cli_help import help_and_imports

COMMANDS = {"eval": EvalOptions, "compare": CompareOptions, "demo": DemoOptions}
REQUIRED = {"model": "embedded:tiny", "data": "task:arithmetic"}
ROOT = Path(__file__).resolve().parents[2]


def _typer_default(field):
    """What typer's option should default to for ``field``: its default (a path as its text); None where
    the field has a default factory (not given: its validator fills the value in)."""
    if field.default_factory is not None:
        return None
    return field.default.as_posix() if isinstance(field.default, Path) else field.default


@pytest.mark.parametrize("command", COMMANDS)
def test_a_commands_parameters_are_its_options_fields_with_the_same_defaults(command):
    options = COMMANDS[command]
    params = typer.main.get_command(app).commands[command].params
    assert [p.name for p in params] == list(options.model_fields)
    for p in params:
        if p.name == "stop":  # None: not given (the field's validator fills in </answer>)
            continue
        assert p.required == options.model_fields[p.name].is_required(), p.name
    given = {p.name: REQUIRED[p.name] if p.required else p.default for p in params}
    assert options.from_cli(given) == options(**{k: v for k, v in given.items() if k in REQUIRED})


@pytest.mark.parametrize("command", COMMANDS)
def test_a_commands_flags_defaults_and_help_are_its_fields_own(command):
    options = COMMANDS[command]
    params = typer.main.get_command(app).commands[command].params
    for p in params:
        field = options.model_fields[p.name]
        assert p.help == " ".join(field.description.split()), p.name
        assert p.opts == [options.flag(p.name)], p.name
        if field.is_required():
            assert p.required, p.name
        else:
            assert p.default == _typer_default(field) and type(p.default) is type(_typer_default(field)), p.name
        if p.default is True:  # a boolean that is on unless turned off
            assert p.secondary_opts == ["--no-" + options.flag(p.name)[2:]], p.name


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_an_options_command_imports_neither_the_options_module_nor_torch(command):
    text, imported = help_and_imports(command, "grpolab.cli.options")
    assert "--seed" in text and imported == []


def test_an_edited_options_class_is_read_from_its_source_not_from_a_stale_snapshot(tmp_path, monkeypatch):
    from grpolab.cli import fields

    data = json.loads(fields.SNAPSHOT.read_text(encoding="utf-8"))
    entry = data["options"]["eval"]
    entry["hash"] = "0" * 16  # as if EvalOptions were edited since the snapshot
    entry["options"][0]["description"] = "stale"
    stale = tmp_path / "fields.json"
    stale.write_text(json.dumps(data), encoding="utf-8")
    live = {row["name"]: fields.OptionDoc(**row) for row in fields.options_entry(EvalOptions)["options"]}
    monkeypatch.setattr(fields, "SNAPSHOT", stale)
    assert fields.command_options("eval") == live
    entry["hash"] = fields.options_entry(EvalOptions)["hash"]  # another class of the file edited: this one current
    current = tmp_path / "current.json"
    current.write_text(json.dumps(data), encoding="utf-8")
    monkeypatch.setattr(fields, "SNAPSHOT", current)
    assert fields.command_options("eval")["model"].description == "stale"
    monkeypatch.setattr(fields, "SNAPSHOT", tmp_path / "missing.json")
    assert fields.command_options("demo") == {
        row["name"]: fields.OptionDoc(**row) for row in fields.options_entry(DemoOptions)["options"]}


@pytest.mark.parametrize("options", COMMANDS.values(), ids=COMMANDS)
def test_every_option_is_described(options):
    assert not [name for name, field in options.model_fields.items() if not field.description]


@pytest.mark.parametrize("option,field,values", [
    ("dtype", "dtype", ["float32", "bfloat16", "float16", "fp32"]),
    ("backend", "rollout_backend", ["hf", "vllm", "trl"]),
    ("max_tokens", "sampling_max_tokens", [1, 0, -5]),
    ("min_tokens", "sampling_min_tokens", [0, 3, -1]),
    ("n", "eval_examples", [1, 0]),
    ("temperature", "eval_temperature", [0.0, 0.7, -0.1]),
    ("reward_timeout_s", "reward_timeout_s", [0.0, 2.5, -1.0]),
])
def test_an_option_that_is_a_config_field_takes_and_refuses_what_that_field_does(option, field, values):
    """The property, not the annotation: for each value, the option accepts it exactly when the
    training config's field does (GRPO's config: it samples with vLLM too; a minimum of 0 new tokens
    beside the maximum, on both sides, so that only the field's own rule decides)."""
    from grpolab.algorithms.grpo import GRPOConfig

    beside = ({"sampling_min_tokens": 0}, {"min_tokens": 0}) if option == "max_tokens" else ({}, {})
    for value in values:
        try:
            GRPOConfig.build(None, {field: value, **beside[0]})
            config_takes = True
        except ConfigError:
            config_takes = False
        try:
            EvalOptions.from_cli({**REQUIRED, option: value, **beside[1]})
            option_takes = True
        except ConfigError:
            option_takes = False
        assert option_takes == config_takes, (option, value, option_takes)
    assert typing.get_args(DemoOptions.model_fields["dtype"].annotation) == ("float32", "bfloat16")


@pytest.mark.parametrize("options,given,says", [
    (EvalOptions, {"n": 0}, "--n must be at least 1, got 0"),
    (EvalOptions, {"k": 0}, "--k must be at least 1, got 0"),
    (EvalOptions, {"dtype": "float16"}, "--dtype must be auto, float32 or bfloat16, got 'float16'"),
    (EvalOptions, {"backend": "trl"}, "--backend must be hf or vllm, got 'trl'"),
    (EvalOptions, {"min_tokens": 2000}, "--min-tokens must be within [0, --max-tokens (1024)], got 2000"),
    (EvalOptions, {"min_tokens": -1}, "--min-tokens must be at least 0, got -1"),
    (EvalOptions, {"task_options": ["digits"]}, "--task-option 'digits': expected KEY=VALUE"),
    (EvalOptions, {"task_options": ["digits=2"], "data": "questions.jsonl"}, "--task-option applies to a generated"),
    (EvalOptions, {"reward_timeout_s": -1.0}, "--reward-timeout must be at least 0"),
    (EvalOptions, {"rag_top_k": 0}, "--rag-top-k must be at least 1, got 0"),
    (EvalOptions, {"temperature": float("nan")}, "--temperature: Input should be a finite number (got nan)"),  # CE09
    (EvalOptions, {"reward_timeout_s": float("inf")}, "--reward-timeout: Input should be a finite number"),
    (EvalOptions, {"reward": "no_such_reward"}, "reward: unknown reward 'no_such_reward'"),
    (CompareOptions, {"steps": 0}, "--steps must be at least 1, got 0"),
    (CompareOptions, {"variants": "grpo", "seeds": 0}, "--seeds must be at least 1, got 0"),
    (CompareOptions, {"variants": "grpo", "env": "env.yaml"}, "--env applies to the method comparison"),
    (CompareOptions, {"data": "rg:basic_arithmetic"}, "--model and --data apply to --variants"),
    (DemoOptions, {"dtype": "float16"}, "--dtype must be float32 or bfloat16, got 'float16'"),
])
def test_a_refused_option_is_one_line_naming_its_flag(options, given, says):
    base = REQUIRED if options is EvalOptions else {}
    with pytest.raises(ConfigError) as err:
        options.from_cli({**base, **given})
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_eval_options_read_the_command_lines_forms():
    opts = EvalOptions.from_cli({**REQUIRED, "stop": None, "task_options": ["digits=2", "wrong=true"],
                                 "reward": "[{fn: r1_zero, weight: 1}]", "rag_corpus": "c.jsonl", "rag_top_k": 2})
    assert opts.stop == ["</answer>"] and opts.task_options == {"digits": 2, "wrong": True}
    # text as typed, as a training command's --field value: YAML would cut ' #...' and read 'k: v' as a mapping
    text = EvalOptions.from_cli({**REQUIRED, "task_options": ["prefix=Q #1: a", "names=[a, b]"]}).task_options
    assert text == {"prefix": "Q #1: a", "names": ["a", "b"]}
    assert opts.reward == [{"fn": "r1_zero", "weight": 1.0}]
    assert opts.retrieval == {"corpus": "c.jsonl", "top_k": 2}
    assert EvalOptions.from_cli({**REQUIRED, "stop": ["", "\n\n"]}).stop == ["\n\n"]  # --stop '' drops the default
    assert EvalOptions.from_cli({**REQUIRED, "stop": [""]}).stop == []
