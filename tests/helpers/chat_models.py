"""A tiny chat model for the light suite: the embedded character tokenizer with ChatML's special
tokens and chat template (eos = ``<|im_end|>``, as SmolLM2 and Qwen2.5-Instruct), and the tiny
Llama sized to it, saved as an ordinary Hugging Face directory."""

from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_tokenizer():
    from grpolab.models import build_char_tokenizer, prepare_tokenizer

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    return prepare_tokenizer(tok)


def chat_model_dir(path: Path, seed: int = 0) -> Path:
    """A tiny Llama with the chat tokenizer, saved (safetensors) to ``path``."""
    from grpolab.models import build_tiny_model, save_model_and_tokenizer

    tok = chat_tokenizer()
    return save_model_and_tokenizer(build_tiny_model("tiny", tokenizer=tok, seed=seed), tok, path)
