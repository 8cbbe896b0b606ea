"""Native function calling under hostile model output and bad tools: the probe's cases F01, F02,
F04, F08 and F09 (``../shared/probes/turn5/reliability-cases.md``, section 6)."""

import subprocess
import sys
import textwrap

import pytest

from grpolab.envs import build_env
from grpolab.envs.chat_tools import function_schema, parse_tool_calls
from tests.helpers.chat_models import chat_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def star(*args: int) -> int:
    """Add them.

    Args:
        args: The numbers.
    """
    return sum(args)


def kw(**kwargs: str) -> str:
    """Join them.

    Args:
        kwargs: The words.
    """
    return " ".join(kwargs.values())


@pytest.mark.parametrize("body", ["[" * 1000, '{"a":' * 3000, '{"name": "add", "arguments": {"a": ' + "9" * 5000
                                  + ', "b": 1}}', '{"name": "add", "arguments": "{\\"a\\": ' + "9" * 5000 + '}"}'])
def test_F01_parse_tool_calls_never_raises_on_deep_nesting_or_huge_integers(body):
    """F01: 1000 nested brackets (RecursionError in json) or a 5000-digit integer (ValueError past
    Python's 4300-digit limit) is a failed call, not an exception that ends the run."""
    content, calls = parse_tool_calls(f"I will call.<tool_call>{body}</tool_call>")
    assert content == "I will call." and len(calls) == 1 and calls[0].problem


def test_F08_a_closing_tag_inside_a_json_string_is_part_of_the_argument():
    """F08: ``</tool_call>`` inside a JSON string argument is valid JSON, not the end of the block."""
    text = '<tool_call>{"name": "f", "arguments": {"x": "a </tool_call> b"}}</tool_call> then'
    _, calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.problem) for c in calls] == [("f", {"x": "a </tool_call> b"}, None)]
    _, two = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{bad</tool_call>')
    assert two[0].problem is None and two[1].problem.startswith("tool call is not JSON")


@pytest.mark.parametrize("fn", [star, kw])
def test_F09_variadic_tools_are_refused_in_one_line(fn):
    """F09: a ``*args``/``**kwargs`` tool was described as one named argument its call then refused."""
    with pytest.raises(ValueError, match=rf"^tool '{fn.__name__}': \*{{1,2}}\w+ cannot be described as named JSON"):
        function_schema(fn)


def test_F04_arguments_of_the_wrong_type_are_one_tool_error_naming_the_argument():
    """F04: ``add(a: int, b: int)`` called with strings concatenated them ("12") silently."""
    env = build_env([add], tokenizer=chat_tokenizer(), tool_format="chat_template", chat_template="hermes")
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": "1", "b": "2"}}</tool_call>'
                                '<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2]}}</tool_call>'
                                '<tool_call>{"name": "add", "arguments": {"a": true, "b": 2}}</tool_call>'
                                '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    out = env.run(env.tools_for_rollout(), calls)
    assert out[0].error == "TypeError: argument 'a' must be integer, got string \"1\" (the tool's schema)"
    assert out[1].error.startswith("TypeError: argument 'b' must be integer, got array")
    assert out[2].error.startswith("TypeError: argument 'a' must be integer, got boolean")
    assert (out[3].text, out[3].error) == ("3", None)


HANGING_TOOL_RUN = textwrap.dedent("""
    import time
    from grpolab.envs import build_env
    from grpolab.envs.chat_tools import parse_tool_calls
    from tests.helpers.chat_models import chat_tokenizer

    def hang() -> str:
        '''Never returns.'''
        while True:
            time.sleep(1)

    env = build_env([hang], tokenizer=chat_tokenizer(), tool_format="chat_template", chat_template="hermes",
                    tool_timeout_s=0.5)
    _, calls = parse_tool_calls('<tool_call>{"name": "hang", "arguments": {}}</tool_call>' * 5)
    print([o.error for o in env.run(env.tools_for_rollout(), calls)], flush=True)
""")


def test_F02_a_hung_python_tool_does_not_keep_a_finished_process_from_exiting():
    """F02: five calls of a tool that never returns time out one by one, every one gets its own
    timeout (no pool of 4 left full), and the process then exits instead of joining the threads."""
    try:
        done = subprocess.run([sys.executable, "-c", HANGING_TOOL_RUN], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the process whose tool calls timed out did not exit within 120 s (F02)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(["timed out after 0.5s"] * 5)
