"""The embedded default: a tiny Llama-architecture model and a character-level tokenizer.

Llama rather than Qwen2 (the two differ only by Qwen2's q/k/v biases): transformers 5 loads a
``qwen2`` directory's tokenizer as ``Qwen2Tokenizer`` whatever ``tokenizer.json`` says, which would
replace the character-level pre-tokenizer; a ``llama`` directory keeps it.

Both are ordinary Hugging Face objects: ``save_pretrained`` writes a directory that
``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` (and vLLM) load back. Nothing is
downloaded.

The tokenizer maps every printable ASCII character and newline to one token; the four R1-Zero
tags (``<think>``, ``</think>``, ``<answer>``, ``</answer>``) are single tokens too, which keeps
embedded-task responses short (a choice; they still decode to their text). Unknown characters map
to ``<unk>``.
"""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
CHARACTERS = [chr(i) for i in range(32, 127)] + ["\n"]

# name -> LlamaConfig fields. tiny ~0.9M parameters, small ~9.5M.
TINY_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=5, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=2),
}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level ``PreTrainedTokenizerFast`` with pad/bos/eos/unk special tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + TAG_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TAG_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="right",
    )


def build_tiny_model(
    size: str = "tiny", tokenizer=None, seed: int = 0, max_position_embeddings: int = 512
) -> LlamaForCausalLM:
    """A randomly initialised Llama causal LM of the named size (``tiny`` or ``small``), float32."""
    if size not in TINY_SIZES:
        raise ValueError(f"unknown embedded model size {size!r}; expected one of {', '.join(TINY_SIZES)}")
    tokenizer = tokenizer or build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rope_theta=10000.0,
        **TINY_SIZES[size],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
