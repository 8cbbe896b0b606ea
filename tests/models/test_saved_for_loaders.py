"""Interop D10/D11 (issue 58 item 4): a run's ``final/`` and checkpoints read like any Hugging Face
directory — 0755 directories and 0644 files under umask 022, not ``mkdtemp``'s 0700 and transformers'
0600 weights — and their ``config.json`` carries the top-level keys transformers 4.46-4.x reads
(``rope_theta``, ``torch_dtype``), which transformers 5 writes only inside ``rope_parameters``: 4.57
loads a file without ``rope_theta`` with RoPE base 10000, silently wrong for SmolLM2 (100000)."""

import json
import os
import stat

import torch

from grpolab.models.tiny import build_char_tokenizer
from grpolab.training.checkpoints import CheckpointManager, save_final


def _llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=100000.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(config).eval()


def _modes(root):
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    out.update({p.name: stat.S_IMODE(p.stat().st_mode) for p in root.iterdir()})
    return out


def test_final_and_checkpoints_are_readable_and_load_identically(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_char_tokenizer()
    model = _llama(tok)
    old = os.umask(0o022)
    try:
        final = save_final(model, tok, tmp_path / "run" / "final")
        step = CheckpointManager(tmp_path / "run" / "checkpoints").save(1, model, tok, {"step": 1})
    finally:
        os.umask(old)
    for directory in (final, step):
        modes = _modes(directory)
        assert modes["."] == 0o755 and modes["model.safetensors"] == 0o644, modes
        assert {m for name, m in modes.items() if name != "."} == {0o644}, modes
        config = json.loads((directory / "config.json").read_text())
        assert config["rope_theta"] == 100000.0 and config["torch_dtype"] == "float32", config
    assert AutoConfig.from_pretrained(final).rope_parameters["rope_theta"] == 100000.0
    loaded = AutoModelForCausalLM.from_pretrained(final).eval()
    ids = torch.tensor([tok("2+3=5", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
