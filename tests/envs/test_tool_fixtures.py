"""Custom tools for the environment tests (no tests here), in a module that imports nothing heavy, so the
supervised tool worker that imports them ("tests.envs.test_tool_fixtures:slow_tool") starts quickly."""

import time


def echo_tool(query: str) -> str:
    return f"echo {query}"


def slow_tool(query: str) -> str:
    if query == "hang":
        time.sleep(60)
    return f"fast {query}"


def failing_tool(query: str) -> str:
    raise RuntimeError(f"cannot handle {query}")


def int_tool(query: str) -> str:
    return 7  # not a str: an error observation


def huge_tool(query: str) -> str:
    return "<ans" + "wer>" + "x" * (int(query) << 20)  # query MB of output


def hog_tool(query: str) -> str:
    block = bytearray(int(query) << 20)  # query MB of address space (untouched: no real memory)
    return f"allocated {len(block) >> 20} MB"
