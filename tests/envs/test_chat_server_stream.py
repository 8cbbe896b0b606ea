"""Issue 58 item 1 (interop D1): ``stream: true`` is served as OpenAI ``chat.completion.chunk`` events, and
three real streaming clients — the openai SDK, LangChain's ``.stream()`` and openai-agents'
``Runner.run_streamed`` — make a whole tool round trip with the taught model (test_chat_tools), while the
server still records the exact sampled ids of every turn."""

import asyncio
import json

import openai
import pytest

from grpolab.envs.chat_server import ChatServer
from grpolab.envs.chat_tools import CALCULATE_SCHEMA
from grpolab.rollout import HFRolloutBackend
from tests.envs.test_chat_tools import COMPACT_TOOLS, taught  # noqa: F401 - the taught model fixture


@pytest.fixture(scope="module")
def server(taught):  # noqa: F811 - the fixture
    model, tok, _, _ = taught
    with ChatServer(HFRolloutBackend(model, tok), tok, chat_template=COMPACT_TOOLS, max_tokens=120) as s:
        yield s


def test_the_openai_sdk_streams_a_tool_call_then_the_answer_with_usage(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is 12+30?"}]

    def stream(messages):
        chunks = list(client.chat.completions.create(model="policy@s", messages=messages, tools=[CALCULATE_SCHEMA],
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks and chunks[-1].usage is not None and chunks[-1].choices == []
        return chunks

    chunks = stream(messages)
    deltas = [c.choices[0] for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["tool_calls"]
    assert len(calls) == 1 and calls[0].function.name == "calculate"
    assert json.loads(calls[0].function.arguments) == {"expression": "12+30"}
    first = server.exchanges("policy@s")[0]
    assert chunks[-1].usage.completion_tokens == len(first.completion_ids)
    assert [d.model_extra.get("token_ids") for d in deltas if d.finish_reason] == [first.completion_ids]
    call = {"id": calls[0].id, "type": "function",
            "function": {"name": "calculate", "arguments": calls[0].function.arguments}}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "42"}]
    chunks = stream(messages)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "42"
    second = server.exchanges("policy@s")[1]
    assert second.chained and second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == \
        first.prompt_ids + first.completion_ids


def test_langchain_stream_round_trips_a_tool_call(server):
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (the dev extra has it)")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression.
        """
        return str(eval(expression))  # noqa: S307 - the test's own sums

    llm = ChatOpenAI(model="policy@lc", base_url=server.url, api_key="unused", temperature=0, max_retries=0)
    bound = llm.bind_tools([calculate])
    messages = [HumanMessage("What is 12+30?")]
    chunks = list(bound.stream(messages))
    ai = chunks[0]
    for c in chunks[1:]:
        ai = ai + c
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("calculate", {"expression": "12+30"})]
    messages += [ai, ToolMessage(calculate.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    answer = "".join(c.content for c in bound.stream(messages))
    assert answer == "42"
    assert [e.chained for e in server.exchanges("policy@lc")] == [False, True]


def test_openai_agents_run_streamed_runs_the_tool_and_answers(server):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (the dev extra has it)")
    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression.
        """
        ran.append(expression)
        return str(eval(expression))  # noqa: S307 - the test's own sums

    async def go():
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        model = agents.OpenAIChatCompletionsModel(model="policy@agent", openai_client=client)
        agent = agents.Agent(name="calc", model=model, tools=[calculate],
                             model_settings=agents.ModelSettings(temperature=0.0))
        result = agents.Runner.run_streamed(agent, "What is 12+30?")
        async for _ in result.stream_events():
            pass
        await client.close()
        return result.final_output

    assert asyncio.run(go()) == "42"
    assert ran == ["12+30"]
    assert len(server.exchanges("policy@agent")) == 2
