"""Issue 58 item 2: each deviation of the interop report (../shared/probes/turn5/interop.md, D2-D9) from
the OpenAI/vLLM API fixed or refused in one 400 line, checked with the real ``openai`` client."""

import openai
import pytest
import torch

from grpolab.envs.chat_server import ChatServer
from grpolab.envs.chat_tools import HERMES_TEMPLATE
from grpolab.models.fused_head import response_log_probs
from grpolab.models.tiny import build_tiny_model
from grpolab.rollout import HFRolloutBackend
from tests.helpers.chat_models import chat_tokenizer

Q = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tiny():
    tok = chat_tokenizer()
    return build_tiny_model("tiny", tok, seed=0).eval(), tok


@pytest.fixture(scope="module")
def served(tiny):
    model, tok = tiny
    with ChatServer(HFRolloutBackend(model, tok), tok) as server:  # max_tokens: up to the context (512)
        yield server, openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def ask(client, messages=Q, model="policy@api", **kw):
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=model, messages=messages, **kw)


def test_d3_a_seeded_request_repeats_and_d2_its_stop_string_is_left_out(served):
    _, client = served
    first = ask(client, seed=5)
    again = ask(client, seed=5)  # the same model name: no per-name counter moves the seed
    assert again.choices[0].token_ids == first.choices[0].token_ids
    text = next(t for t in (ask(client, seed=s).choices[0].message.content for s in range(5, 40)) if len(t) >= 6)
    seed = next(s for s in range(5, 40) if ask(client, seed=s).choices[0].message.content == text)
    stop = text[3]
    cut = ask(client, seed=seed, stop=[stop]).choices[0]
    assert cut.message.content == text[: text.index(stop)] and cut.finish_reason == "stop"
    assert cut.stop_reason == stop and first.choices[0].stop_reason is None  # vLLM's: which stop string ended it
    assert cut.token_ids == ask(client, seed=seed).choices[0].token_ids[: len(cut.token_ids)]  # the ids as sampled
    kept = ask(client, seed=seed, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.message.content == text[: text.index(stop) + 1]  # vLLM's option keeps it


def test_d4_max_tokens_past_256_is_honoured_up_to_the_context_and_refused_past_it(served):
    _, client = served
    long = ask(client, max_tokens=300, seed=0, extra_body={"min_tokens": 300}).choices[0]
    assert len(long.token_ids) == 300 and long.finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="context is 512 tokens.*max_tokens 500 would run past it"):
        ask(client, max_tokens=500)  # with the prompt's tokens, past the context: refused, not cut
    with pytest.raises(openai.BadRequestError, match="max_tokens 600 is over this server's limit of 512"):
        ask(client, max_tokens=600)


def test_d5_log_probs_only_when_asked_with_token_text_and_top_logprobs(served, tiny):
    _, tok = tiny
    _, client = served
    assert ask(client, seed=1).choices[0].logprobs is None
    choice = ask(client, seed=1, logprobs=True, top_logprobs=3).choices[0]
    entries = choice.logprobs.content
    assert [e.token for e in entries] == [tok.decode([t]) for t in choice.token_ids]
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-5 and
               [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
               for e in entries)
    as_ids = ask(client, seed=1, logprobs=True, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert [e.token for e in as_ids.logprobs.content] == [f"token_id:{t}" for t in as_ids.token_ids]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        ask(client, top_logprobs=2)


def test_d6_log_probs_are_the_raw_models_by_default_and_the_samplers_as_processed_logprobs(tiny):
    model, tok = tiny

    def values(mode):
        with ChatServer(HFRolloutBackend(model, tok), tok, logprobs_mode=mode) as server:
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
            r = ask(client, seed=2, temperature=0.7, logprobs=True)
            return r.prompt_token_ids, r.choices[0].token_ids, [e.logprob for e in r.choices[0].logprobs.content]

    prompt, ids, raw = values("raw_logprobs")
    assert values("processed_logprobs")[1] == ids
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        at = {t: response_log_probs(model, seq[:, :-1], seq[:, 1:], temperature=t)["log_probs"][0, len(prompt) - 1:]
              for t in (1.0, 0.7)}
    assert torch.allclose(torch.tensor(raw), at[1.0], atol=1e-4)
    assert torch.allclose(torch.tensor(values("processed_logprobs")[2]), at[0.7], atol=1e-4)
    assert not torch.allclose(at[1.0], at[0.7], atol=1e-2)  # the two modes differ on this sample


def test_d7_content_parts_are_read_as_their_text(served):
    _, client = served
    parts = ask(client, [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                                      {"type": "text", "text": "2+2?"}]}], max_tokens=1)
    plain = ask(client, [{"role": "user", "content": "What is\n2+2?"}], max_tokens=1)
    assert parts.prompt_token_ids == plain.prompt_token_ids
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]: only text parts"):
        ask(client, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


UNHONOURED = [({"logit_bias": {"5": -100}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
              ({"frequency_penalty": 1.0}, "frequency_penalty"),
              ({"response_format": {"type": "json_object"}}, "response_format"),
              ({"tool_choice": "required"}, "tool_choice"), ({"parallel_tool_calls": False}, "parallel_tool_calls"),
              ({"extra_body": {"top_k": 5}}, "top_k"),
              ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
              ({"extra_body": {"continue_final_message": True}}, "continue_final_message")]


def test_d8_a_parameter_the_endpoint_does_not_honour_is_refused_by_name(served):
    _, client = served
    for kw, name in UNHONOURED:
        with pytest.raises(openai.BadRequestError, match=name):
            ask(client, **kw)
    # their neutral values change nothing and pass
    assert ask(client, presence_penalty=0, frequency_penalty=0, response_format={"type": "text"}, tool_choice="auto",
               max_tokens=2).choices[0].token_ids


def test_d9_chat_template_hermes_means_the_hermes_template(tiny):
    model, tok = tiny
    with ChatServer(HFRolloutBackend(model, tok), tok, chat_template="hermes") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        got = ask(client, max_tokens=1).prompt_token_ids
    text = tok.apply_chat_template(Q, chat_template=HERMES_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert got == tok(text, add_special_tokens=False)["input_ids"]
