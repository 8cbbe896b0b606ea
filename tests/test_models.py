import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.models import (
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
    with pytest.raises(ValueError, match="no such model directory"):
        load_model_and_tokenizer(str(tmp_path / "missing"))
