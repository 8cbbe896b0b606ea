"""A two-turn verifiers game (a custom ``MultiTurnEnv``): the model is asked for a colour, the
environment answers with the secret word of the row, and the model must say it back.

``setup_state`` keeps the secret in the state; ``env_response`` writes the user's second turn;
the rubric reads the state: ``said_secret`` (weight 1.0) is 1 when the model's last turn contains
the secret, and ``turn_count`` (weight 0.0, a metric) is the number of model turns.
``load_environment(fail=...)``: ``"raise"`` makes env_response raise, ``"hang"`` makes it sleep.
"""

import asyncio

import datasets
import verifiers as vf

WORDS = ["red", "blue", "gold", "jade", "teal", "pink", "gray", "ruby"]


class SecretGame(vf.MultiTurnEnv):
    def __init__(self, fail: str | None = None, **kw):
        super().__init__(max_turns=2, **kw)
        self.fail = fail

    async def setup_state(self, state):
        state["secret"] = state["answer"]
        return state

    async def env_response(self, messages, state, **kwargs):
        if self.fail == "raise":
            raise RuntimeError("the game broke")
        if self.fail == "hang":
            await asyncio.sleep(600)
        return [vf.UserMessage(content=f"Say {state['secret']}.")]


def said_secret(completion, state) -> float:
    last = [m for m in completion if m["role"] == "assistant"][-1]
    return 1.0 if state["secret"] in str(last["content"] or "") else 0.0


def turn_count(completion) -> float:
    return float(sum(m["role"] == "assistant" for m in completion))


def load_environment(n: int = 16, fail: str | None = None) -> vf.Environment:
    rows = [{"question": f"Colour {i}?", "answer": WORDS[i % len(WORDS)]} for i in range(n)]
    return SecretGame(fail=fail, dataset=datasets.Dataset.from_list(rows),
                      rubric=vf.Rubric(funcs=[said_secret, turn_count], weights=[1.0, 0.0]))
