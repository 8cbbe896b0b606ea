"""Stop strings by decoded text whatever the tokenisation, and every end id of the model.

The model here is a "bigram" Llama: one layer whose output projections are zero (the residual
stream is the token embedding), one-hot embeddings and an lm_head that maps token ``a`` to the next
token of a chain with a huge logit. It writes exactly the chain, through both the lean decoder and
the Hugging Face forward, whatever the sampling temperature; so every spelling of ``</answer>`` can
be forced.
"""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grpolab.rollout import HFRolloutBackend, SamplingParams, fast_decoder
from grpolab.rollout.stops import StopStringDetector, stop_end

SPECIALS = ["<pad>", "</s>", "<unk>", "<|end|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz<>/=+0123456789 Q")


@pytest.fixture(scope="module")
def tok():
    """BPE over characters with merges ``r>`` and ``r>x`` (a token straddling ``</answer>``'s
    end), plus ``</answer>`` as one added token."""
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS + ["r>", "r>x"])}
    bpe = Tokenizer(models.BPE(vocab, [("r", ">"), ("r>", "x")], unk_token="<unk>"))
    bpe.decoder = decoders.Fuse()
    bpe.add_special_tokens(SPECIALS)
    bpe.add_tokens(["</answer>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def ids_of(tok, pieces):
    return tok.convert_tokens_to_ids(pieces)


def bigram_model(tok, chain, end_ids=None):
    v = len(tok)
    hidden = 64
    cfg = LlamaConfig(vocab_size=v, hidden_size=hidden, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name else 0.0)
        assert v <= hidden
        model.model.embed_tokens.weight[:, :v] = torch.eye(v)
        ids = ids_of(tok, chain)
        for a, b in zip(ids, ids[1:]):
            model.lm_head.weight[b, a] = 100.0
    model.generation_config.eos_token_id = tok.eos_token_id if end_ids is None else end_ids
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def run(tok, chain, fast_path, end_ids=None, **sampling):
    model = bigram_model(tok, chain, end_ids)
    assert fast_decoder.supports(model)
    backend = HFRolloutBackend(model, tok, fast_path=fast_path)
    return backend.generate(["7 Q"], 2, SamplingParams(seed=0, **sampling))


SPELLINGS = {
    "one token": ["Q", "4", "=", "</answer>", "x", "y", "z"],
    "characters": ["Q", "4", "=", "<", "/", "a", "n", "s", "w", "e", "r", ">", "x", "y", "z"],
    "straddling token": ["Q", "4", "=", "<", "/", "a", "n", "s", "w", "e", "r>x", "y", "z"],
}


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_stop_string_is_found_however_it_is_spelled(tok, spelling, fast_path):
    chain = SPELLINGS[spelling]
    last = next(i for i, piece in enumerate(chain) if piece in ("</answer>", ">", "r>x"))
    for r in run(tok, chain, fast_path, max_tokens=20, stop=["</answer>"]):
        assert r.finish_reason == "stop"
        assert r.response == "4=</answer>"  # kept, and nothing after it (not the straddling "x")
        assert r.response_ids == ids_of(tok, chain[1 : last + 1])  # the exact sampled ids
        assert len(r.logprobs) == len(r.response_ids)


@pytest.mark.parametrize("fast_path", [True, False])
def test_the_first_occurrence_of_any_stop_string_ends_the_row(tok, fast_path):
    chain = SPELLINGS["characters"]
    r = run(tok, chain, fast_path, max_tokens=20, stop=["</answer>", "ns"])[0]
    assert (r.response, r.finish_reason) == ("4=</ans", "stop")
    r = run(tok, SPELLINGS["straddling token"], fast_path, max_tokens=20, stop=["r>xy", "</answer>"])[0]
    assert (r.response, r.finish_reason) == ("4=</answer>", "stop")


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_stop_string_completed_before_min_tokens_is_ignored(tok, fast_path):
    chain = SPELLINGS["characters"]  # "4=</answer>xyz"
    # "/a" ends at the 5th token: ignored under min_tokens=5 (vLLM's rule: a stop must end after the
    # first min_tokens tokens), and never found again afterwards; found under min_tokens=4
    r = run(tok, chain, fast_path, max_tokens=12, min_tokens=5, stop=["/a"])[0]
    assert (r.response, r.finish_reason) == ("4=</answer>x", "length")
    r = run(tok, chain, fast_path, max_tokens=12, min_tokens=4, stop=["/a"])[0]
    assert (r.response, r.finish_reason) == ("4=</a", "stop")


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("form", ["list", "int"])
def test_every_end_id_of_the_generation_config_ends_the_row(tok, fast_path, form):
    end = tok.convert_tokens_to_ids("<|end|>")
    end_ids = [tok.eos_token_id, end] if form == "list" else end
    for r in run(tok, ["Q", "a", "<|end|>", "b", "c"], fast_path, end_ids=end_ids, max_tokens=10):
        assert r.finish_reason == "eos"
        assert r.response_ids == ids_of(tok, ["a", "<|end|>"]) and r.response == "a"  # kept in the ids only
    # min_tokens forbids every end id, not only the tokenizer's eos
    for r in run(tok, ["Q", "a", "<|end|>", "b", "c"], fast_path, end_ids=end_ids, max_tokens=6, min_tokens=3):
        assert end not in r.response_ids[:3] and tok.eos_token_id not in r.response_ids[:3]


def test_detector_checks_only_tokens_that_can_end_a_stop_string(tok):
    det = StopStringDetector(tok, ["</answer>"])
    mask = det.candidates(len(tok) + 2, "cpu")
    ids = dict(zip(["a", ">", "r>", "r>x", "</answer>"], ids_of(tok, ["a", ">", "r>", "r>x", "</answer>"])))
    assert not mask[ids["a"]] and mask[ids[">"]] and mask[ids["r>"]] and mask[ids["r>x"]] and mask[ids["</answer>"]]
    assert mask[len(tok)] and mask[len(tok) + 1]  # ids past the tokenizer: checked, to be safe
    spell = ids_of(tok, list("</answer"))
    assert det.completes([spell + [ids[">"]], spell, spell[:-1] + [ids["r>x"]], [ids["</answer>"]],
                          spell + [ids[">"], ids["a"]]]) == [True, False, True, True, False]
    assert det.window == len("</answer>") + 2


def test_detector_on_byte_level_pieces_of_one_character():
    """A stop string ending in a multi-byte character that the model writes byte by byte."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    bl = Tokenizer(models.BPE(vocab, []))
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    btok = PreTrainedTokenizerFast(tokenizer_object=bl)
    ids = btok("xé", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3  # "x" and the two bytes of "é"
    det = StopStringDetector(btok, ["xé"])
    assert det.candidates(len(btok), "cpu")[ids[1:]].all()  # each byte alone decodes to a partial
    assert det.completes([ids[:2], ids]) == [False, True]


def test_stop_end_is_the_earliest_ending_new_occurrence():
    assert stop_end("a</answer>b</answer>", ["</answer>"]) == 10
    assert stop_end("a</answer>b</answer>", ["</answer>"], after=10) == 20
    assert stop_end("xx ns</answer>", ["</answer>", "ns"]) == 5
    assert stop_end("abc", ["d"]) == -1
