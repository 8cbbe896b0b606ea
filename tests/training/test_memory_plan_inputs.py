"""``grpolab plan``'s inputs are checked as they are read: the flags (``--gpu-memory``, ``--nproc``,
``--prompt-tokens``) and the model's config.json, each wrong value one line naming the flag, or the
file and its key; no negative or zero shape, process count or token count reaches the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpolab.training.plan_inputs import ARCHITECTURES, Hardware, ModelShape

ROOT = Path(__file__).resolve().parents[2]
GOOD = dict(ARCHITECTURES["Qwen2.5-Math-1.5B"], num_hidden_layers=2)


def _plan(args: list[str], monkeypatch):
    from typer.testing import CliRunner

    from grpolab import cli

    monkeypatch.chdir(ROOT)
    return CliRunner().invoke(cli.app, ["plan", "--config", "configs/grpo_tiny.yaml", *args])


def _one_line(out, says: str) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.exit_code == 2 and len(lines) == 1 and says in lines[0], (out.exit_code, out.stderr, out.stdout)
    return lines[0]


@pytest.mark.parametrize("memory", ["inf", "nan", "1e308", "-80", "0"])
def test_gpu_memory_that_is_not_a_finite_size_is_one_line(memory, monkeypatch):
    _one_line(_plan(["--gpus", "1", "--gpu-memory", memory], monkeypatch), "--gpu-memory: give each GPU's memory")


@pytest.mark.parametrize("nproc", ["0", "-2"])
def test_nproc_below_one_is_one_line(nproc, monkeypatch):
    _one_line(_plan(["--nproc", nproc], monkeypatch), f"--nproc: give the number of processes (>= 1), got {nproc}")


@pytest.mark.parametrize("tokens,says", [
    ("-5", "--prompt-tokens: give the longest prompt's length in tokens (>= 1), got -5"),
    ("0", "(>= 1), got 0"),
    ("100000000000", "--prompt-tokens: 100000000000 tokens leave no room for a response in the model's context of "
                     "512 tokens (max_position_embeddings from embedded:tiny)"),
    ("512", "512 tokens leave no room"),
])
def test_prompt_tokens_below_one_or_beyond_the_context_is_one_line(tokens, says, monkeypatch):
    _one_line(_plan(["--prompt-tokens", tokens], monkeypatch), says)


def test_a_prompt_that_leaves_less_than_sampling_max_tokens_is_planned_clamped_with_a_note(monkeypatch):
    out = _plan(["--prompt-tokens", "500"], monkeypatch)
    assert out.exit_code == 0 and "micro-batch 32 x 512 tokens" in out.stdout, out.output
    assert "500 prompt + 32 new tokens (sampling_max_tokens) exceed the model's context of 512" in out.stdout
    assert "exceed" not in _plan(["--prompt-tokens", "480"], monkeypatch).stdout  # 480 + 32: the whole context


@pytest.mark.parametrize("text,says", [
    ('{"hidden_size": Infinity}', "hidden_size must be a positive integer, got Infinity"),
    ('{"hidden_size": NaN}', "hidden_size must be a positive integer, got NaN"),
    ('{"hidden_size": null}', "hidden_size must be a positive integer, got null"),
    ('{"hidden_size": 32.7}', "hidden_size must be a positive integer, got 32.7"),
    ('{"hidden_size": "big"}', 'hidden_size must be a positive integer, got "big"'),
    ('{"hidden_size": true}', "hidden_size must be a positive integer, got true"),
    ('{"hidden_size": -4096}', "hidden_size must be a positive integer, got -4096"),
    ('{"num_hidden_layers": -3}', "num_hidden_layers must be a positive integer, got -3"),
    ('{"num_attention_heads": 0}', "num_attention_heads must be a positive integer, got 0"),
    ('{"vocab_size": [1]}', "vocab_size must be a positive integer, got list"),
    ('{"num_key_value_heads": 5}', "num_key_value_heads (5) must divide num_attention_heads (12)"),
    ('{"max_position_embeddings": 0}', "max_position_embeddings must be a positive integer, got 0"),
    ('{"hidden_size": 8}', "hidden_size 8 over 12 attention heads leaves no head dimension"),
    # P02: a size past 2**40 is a typo (10**400 overflowed a float in the plan's figures)
    ('{"hidden_size": %d}' % 10**400,
     "hidden_size must be at most 2**40 (1,099,511,627,776), got an integer of about 401 digits"),
    ('{"vocab_size": %d}' % (2**40 + 1), "vocab_size must be at most 2**40 (1,099,511,627,776), got 1099511627777"),
    # P03: transformers' strict config refused these with a TypeError traceback
    ('{"tie_word_embeddings": "yes"}', 'tie_word_embeddings must be true or false, got "yes"'),
    ('{"tie_word_embeddings": 1}', "tie_word_embeddings must be true or false, got 1"),
    ('{"attention_bias": null}', "attention_bias must be true or false, got null"),
    ("5", "not a JSON object but int"),
    ("[1, 2, 3]", "not a JSON object but list"),
])
def test_a_config_json_value_that_is_not_a_size_is_one_line_naming_the_file_and_key(text, says, tmp_path, monkeypatch):
    cfg = json.loads(text)  # JSON as Python writes it: Infinity and NaN included
    (tmp_path / "config.json").write_text(json.dumps({**GOOD, **cfg}) if isinstance(cfg, dict) else text)
    line = _one_line(_plan(["--model", str(tmp_path)], monkeypatch), says)
    assert str(tmp_path / "config.json") in line


def test_a_binary_config_json_is_one_line_naming_the_file(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00binary")
    assert str(tmp_path / "config.json") in _one_line(_plan(["--model", str(tmp_path)], monkeypatch), "not a text file")


def test_good_values_still_plan():
    shape = ModelShape.from_config({**GOOD, "num_key_value_heads": None, "head_dim": None}, "test")
    assert shape.num_key_value_heads == GOOD["num_attention_heads"] and shape.head_dim == 1536 // 12
    assert Hardware.detect(2, 80.0, None).memory == 80 * 2**30 and Hardware.detect(None, None, 2).ranks == 2
