import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.models import (
    ModelLoadError,
    build_char_tokenizer,
    build_tiny_model,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    prepare_tokenizer,
    save_model_and_tokenizer,
)


def test_embedded_sizes():
    n_tiny = sum(p.numel() for p in build_tiny_model("tiny").parameters())
    n_small = sum(p.numel() for p in build_tiny_model("small").parameters())
    assert 0.5e6 < n_tiny < 2e6
    assert 5e6 < n_small < 15e6
    with pytest.raises(ValueError, match="huge"):
        build_tiny_model("huge")


def test_char_tokenizer_roundtrip_and_specials():
    tok = build_char_tokenizer()
    text = "Q: 3+5-2\nA: <think>3+5=8 8-2=6</think> <answer>6</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("</answer>", add_special_tokens=False)["input_ids"]) == ["</answer>"]
    assert tok.pad_token_id is not None and tok.eos_token_id is not None and tok.bos_token_id is not None
    assert len({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}) == 3
    assert tok.decode(tok("é", add_special_tokens=False)["input_ids"]) == "<unk>"


def test_embedded_model_save_load_identical_logits(tmp_path):
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=3)
    save_model_and_tokenizer(model, tok, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert not list((tmp_path / "m").glob("*.bin"))
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    t2 = AutoTokenizer.from_pretrained(tmp_path / "m")
    text = "Q: 1+2\nA: <think>"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    assert t2(text, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    model.eval()
    m2.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, m2(ids).logits)
    # and through grpolab's own loader, with dtype and padding side
    m3 = load_model(str(tmp_path / "m"), dtype="bfloat16")
    assert next(m3.parameters()).dtype == torch.bfloat16
    assert load_tokenizer(str(tmp_path / "m"), padding_side="left").padding_side == "left"


def test_seeded_build_is_deterministic():
    a = build_tiny_model("tiny", seed=1).state_dict()
    b = build_tiny_model("tiny", seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pad_defaults_to_eos():
    tok = build_char_tokenizer()
    tok.pad_token = None
    prepare_tokenizer(tok)
    assert tok.pad_token_id == tok.eos_token_id


def test_gradient_checkpointing_and_bad_dir(tmp_path):
    model = load_model("embedded:tiny", gradient_checkpointing=True)
    assert getattr(model, 'is_activation_checkpointing', None) or model.is_gradient_checkpointing
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path / "empty"))


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="^model directory not found: .*missing"):
        load_model_and_tokenizer(str(tmp_path / "missing"))


def _no_hub(monkeypatch):
    """Any call into transformers' loaders fails the test: errors must come before them."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError(f"from_pretrained called with {args} {kwargs}")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


@pytest.mark.parametrize("name", ["runs/sft/final", "final", "Qwen/Qwen2.5-Math-1.5B"])
def test_a_relative_path_or_hub_name_that_is_not_a_directory_is_refused_offline(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    _no_hub(monkeypatch)
    for load in (load_model_and_tokenizer, load_model, load_tokenizer):
        with pytest.raises(ModelLoadError, match=f"^model directory not found: {name} ") as err:
            load(name)
        assert "\n" not in str(err.value)
    (tmp_path / "final").write_text("a file, not a directory")
    with pytest.raises(ModelLoadError, match="model directory not found"):
        load_model("final")


def test_a_directory_without_config_json_is_not_a_model(tmp_path, monkeypatch):
    _no_hub(monkeypatch)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    for load in (load_model_and_tokenizer, load_model):
        with pytest.raises(ModelLoadError, match=f"^no config.json in {tmp_path / 'notes'}"):
            load(str(tmp_path / "notes"))


class _Boom:
    """Unpickling this touches a marker file: proof that a checkpoint was (not) unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_pickled_checkpoint_is_refused_for_safety(tmp_path):
    model, tok = load_model_and_tokenizer("embedded:tiny")
    out = save_model_and_tokenizer(model, tok, tmp_path / "m")
    (out / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    torch.save({"state": _Boom(marker)}, out / "pytorch_model.bin")
    for load in (load_model_and_tokenizer, load_model):
        with pytest.raises(ModelLoadError, match="^pickled checkpoint refused for safety: .* pytorch_model.bin") as err:
            load(str(out))
        assert "safe_serialization=True" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()
    (out / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match="no model weights"):
        load_model(str(out))


def test_a_truncated_weights_file_is_one_line_naming_it(tmp_path):
    model, tok = load_model_and_tokenizer("embedded:tiny")
    out = save_model_and_tokenizer(model, tok, tmp_path / "m")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])  # a copy cut short (a full disk, an interrupted transfer)
    for load in (load_model_and_tokenizer, load_model):
        with pytest.raises(ModelLoadError, match=r"m/model.safetensors: damaged or truncated weights file") as err:
            load(str(out))
        assert "\n" not in str(err.value)


def _custom_code_model(tmp_path):
    """A model directory whose config asks for its own Python code (``auto_map``)."""
    import json

    model, tok = load_model_and_tokenizer("embedded:tiny")
    out = save_model_and_tokenizer(model, tok, tmp_path / "custom")
    cfg = json.loads((out / "config.json").read_text())
    cfg["model_type"] = "grpolab_custom_llama"
    cfg["auto_map"] = {"AutoConfig": "custom_llama.MyConfig", "AutoModelForCausalLM": "custom_llama.MyModel"}
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "custom_llama.py").write_text(
        "import pathlib\n"
        "pathlib.Path(__file__).with_name('CODE_RAN').touch()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class MyConfig(LlamaConfig):\n    model_type = 'grpolab_custom_llama'\n"
        "class MyModel(LlamaForCausalLM):\n    config_class = MyConfig\n"
    )
    return out


def test_remote_code_is_not_run_unless_asked(tmp_path, monkeypatch):
    out = _custom_code_model(tmp_path)
    with pytest.raises(ModelLoadError, match="trust_remote_code") as err:
        load_model(str(out))
    assert "\n" not in str(err.value)
    assert not (out / "CODE_RAN").exists()
    # opting in passes trust_remote_code=True (and local_files_only) through to transformers
    import transformers

    calls = []

    def spy(path, **kwargs):
        calls.append(kwargs)
        return build_tiny_model("tiny")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_model(str(out), trust_remote_code=True)
    assert calls == [dict(dtype=torch.float32, use_safetensors=True, local_files_only=True, trust_remote_code=True)]
    calls.clear()
    load_model(str(out))
    assert calls[0]["trust_remote_code"] is False


def test_the_cli_reports_a_model_error_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from grpolab.cli import app

    result = CliRunner().invoke(app, ["eval", "--model", str(tmp_path / "nope"), "--data", "task:arithmetic"])
    assert result.exit_code == 2, result.output
    assert f"model directory not found: {tmp_path / 'nope'}" in result.output


def test_loading_lives_in_its_own_module():
    import grpolab.models as models
    from grpolab.models import loading

    assert models.load_model is loading.load_model and issubclass(ModelLoadError, ValueError)
    assert all(hasattr(models, name) for name in models.__all__)
