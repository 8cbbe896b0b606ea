"""The OpenAI-compatible chat endpoint over grpolab's sampler, called with the real ``openai`` client:
vLLM's token fields, log-probs equal to the trainer's, exact ids across turns, batching of concurrent
requests, tool calls parsed, and bad requests answered in one line."""

import concurrent.futures as cf
import json

import openai
import pytest
import torch

from grpolab.envs.chat_server import ChatServer
from grpolab.envs.chat_tools import CALCULATE_SCHEMA
from grpolab.models.fused_head import response_log_probs
from grpolab.models.tiny import build_tiny_model
from grpolab.rollout import HFRolloutBackend
from tests.envs.test_chat_tools import COMPACT_TOOLS, taught  # noqa: F401 - the taught model fixture
from tests.helpers.chat_models import chat_tokenizer


class Counting(HFRolloutBackend):
    """The real HF backend, counting its generate calls."""

    calls = 0

    def generate(self, *args, **kwargs):
        type(self).calls += 1
        return super().generate(*args, **kwargs)


@pytest.fixture(scope="module")
def served():
    tok = chat_tokenizer()
    model = build_tiny_model("tiny", tok, seed=0).eval()
    with ChatServer(Counting(model, tok), tok, batch_wait_s=0.5, max_tokens=24) as server:
        yield server, model, tok, openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def ask(client, messages, model="policy@a", **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=1.0, max_tokens=16, **kw)


def test_answers_carry_vllm_token_fields_and_the_samplers_log_probs(served):
    server, model, tok, client = served
    messages = [{"role": "user", "content": "What is 2+2?"}]
    resp = ask(client, messages, seed=3, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    choice = resp.choices[0]
    prompt_ids, ids = resp.prompt_token_ids, choice.token_ids
    assert prompt_ids == tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]
    assert [e.token for e in choice.logprobs.content] == [f"token_id:{t}" for t in ids]
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
    seq = torch.tensor([prompt_ids + ids])
    with torch.no_grad():
        lp = response_log_probs(model, seq[:, :-1], seq[:, 1:])["log_probs"][0, len(prompt_ids) - 1:]
    assert torch.allclose(lp, torch.tensor([e.logprob for e in choice.logprobs.content]), atol=1e-4)
    assert server.exchanges("policy@a")[-1].completion_ids == ids


def test_a_later_turn_continues_from_exactly_the_sampled_ids(served):
    server, _, tok, client = served
    first = [{"role": "user", "content": "Hi"}]
    a = ask(client, first, model="policy@chain")
    second = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "And?"}]
    b = ask(client, second, model="policy@chain")
    assert b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.choices[0].token_ids)] == \
        a.prompt_token_ids + a.choices[0].token_ids
    ex = server.exchanges("policy@chain")
    assert [e.chained for e in ex] == [False, True]
    # a conversation the server never answered starts afresh
    c = ask(client, first + [{"role": "assistant", "content": "zzz"}, {"role": "user", "content": "And?"}],
            model="policy@fresh")
    assert not server.exchanges("policy@fresh")[0].chained
    assert c.prompt_token_ids == tok(tok.apply_chat_template(
        first + [{"role": "assistant", "content": "zzz"}, {"role": "user", "content": "And?"}], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def test_concurrent_requests_are_sampled_in_one_batch(served):
    _, _, _, client = served
    before = Counting.calls
    with cf.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: ask(client, [{"role": "user", "content": f"Q{i}"}], model=f"policy@{i}"),
                                range(4)))
    assert len(answers) == 4 and Counting.calls - before < 4


def test_a_tool_call_and_its_result_round_trip_with_exact_ids(taught):  # noqa: F811 - the fixture
    """The taught model (test_chat_tools) calls calculate through the endpoint, gets the result as a
    tool message, and answers; the second prompt continues the first turn's sampled ids."""
    model, tok, _, _ = taught
    with ChatServer(HFRolloutBackend(model, tok), tok, chat_template=COMPACT_TOOLS, max_tokens=120) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is 12+30?"}]
        a = client.chat.completions.create(model="policy@t", messages=messages, tools=[CALCULATE_SCHEMA],
                                           temperature=0.3, seed=0)
        call = a.choices[0].message.tool_calls[0]
        assert a.choices[0].finish_reason == "tool_calls" and call.function.name == "calculate"
        assert json.loads(call.function.arguments) == {"expression": "12+30"}
        messages += [a.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        b = client.chat.completions.create(model="policy@t", messages=messages, tools=[CALCULATE_SCHEMA],
                                           temperature=0.3, seed=0)
    first = a.prompt_token_ids + a.choices[0].token_ids
    assert b.prompt_token_ids[: len(first)] == first
    assert tok.decode(b.prompt_token_ids[len(first):], skip_special_tokens=False) == \
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert b.choices[0].message.content == "42"
    assert [e.exact for e in server.exchanges("policy@t")] == [True, True]


def test_bad_requests_are_one_line_and_the_server_keeps_serving(served):
    _, _, _, client = served
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        client.chat.completions.create(model="policy", messages=[])
    with pytest.raises(openai.BadRequestError, match="bad sampling settings"):
        ask(client, [{"role": "user", "content": "x"}], top_p=0.0)
    assert ask(client, [{"role": "user", "content": "still there?"}]).choices[0].token_ids
    with pytest.raises(ValueError, match="127.0.0.1 only"):
        ChatServer(None, None, host="0.0.0.0")
