"""Tools the function-calling tests import by name (``tests.envs.chat_tool_fixtures:NAME``)."""

import os


def add(a: int, b: int) -> dict:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return {"sum": a + b, "pid": os.getpid()}


class Counter:
    """A TRL-style environment: its public methods are the tools, its state lives for one rollout."""

    def __init__(self):
        self.n = 0

    def reset(self):
        self.n = 0

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.n += by
        return self.n
