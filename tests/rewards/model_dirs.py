"""Small model directories for the reward-model tests (tests/rewards, tests/eval): a reward model (the tiny
causal LM with a value head, saved as an ordinary ``*ForSequenceClassification`` directory) and the causal LM
itself (no head). A second or so each."""

from __future__ import annotations

import json
from pathlib import Path

from grpolab.models import load_model_and_tokenizer
from grpolab.models.classifier import value_head_model


def reward_model_dir(path: Path, seed: int = 1) -> Path:
    """A one-label reward model saved at ``path``."""
    lm, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    model = value_head_model(lm, seed=seed)
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def causal_lm_dir(path: Path) -> Path:
    """The tiny causal LM (``LlamaForCausalLM``, no classification head) saved at ``path``."""
    lm, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def headless_classifier_dir(path: Path) -> Path:
    """A directory whose config.json says ``LlamaForSequenceClassification`` but whose weights are the causal
    LM's: no ``score.weight`` (transformers would initialise the head at random, with a warning only)."""
    causal_lm_dir(path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (path / "config.json").write_text(json.dumps(config))
    return Path(path)
