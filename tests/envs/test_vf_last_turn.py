"""C5-7: a verifiers ``ToolEnv`` call the model can no longer read the result of (in the last allowed
turn, or whose results leave no room to answer) is not run and adds no ``tool`` message for the
rubric to score, as verifiers' ``MultiTurnEnv.rollout`` stops before ``env_response``."""

from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="the verifiers extra is not installed (pip install -e '.[envs]')")

from grpolab.data.prompts.chat import ChatTemplate  # noqa: E402
from grpolab.data.tasks.vf import VerifiersTask  # noqa: E402
from grpolab.envs import EnvBackend  # noqa: E402
from grpolab.envs.vf import build_vf_env  # noqa: E402
from grpolab.rewards.scoring import RewardScorer  # noqa: E402
from grpolab.rewards.vf_reward import VfRubric  # noqa: E402
from grpolab.rollout import HFRolloutBackend, SamplingParams  # noqa: E402
from tests.envs.test_chat_tools import COMPACT_TOOLS, taught  # noqa: E402,F401 - the taught model fixture

LAST = str(Path(__file__).parent / "vf_envs" / "last_message_tool_env.py")


def run(taught, **options):  # noqa: F811 - the fixture
    model, tok, _, _ = taught
    task = VerifiersTask(LAST)
    env = build_vf_env(LAST, tokenizer=tok, chat_template=COMPACT_TOOLS, **{"max_total_tokens": 240, **options})
    template = ChatTemplate(tok)
    backend = EnvBackend(HFRolloutBackend(model, tok), env, template=template)
    examples = task.examples("train", 2)
    calls = env.functions["calculate"].__globals__["CALLS"]  # the module verifiers loaded the file as
    before = len(calls)
    out = backend.generate([template.format(e.question) for e in examples], 1,
                           SamplingParams(temperature=0.3, max_tokens=120, seed=0))
    with RewardScorer(VfRubric(LAST), timeout_s=60) as scorer:
        scores = scorer.score([r.scored_response for r in out], [e.answer for e in examples], rollouts=out)
    return out, [s["reward"] for s in scores], calls[before:]


def test_c5_7_a_call_in_the_last_allowed_turn_is_not_run_nor_scored(taught):  # noqa: F811 - the fixture
    out, rewards, ran = run(taught)  # the environment's max_turns: 1
    assert all(r.info["tool_calls"] == 1 for r in out)  # the model did call
    assert all(r.messages[-1]["role"] == "assistant" and r.messages[-1]["tool_calls"] for r in out)
    assert not any(m["role"] == "tool" for r in out for m in r.messages)
    assert ran == []  # the tool never ran
    assert rewards == [0.0, 0.0]  # verifiers' score: the completion ends with the call (was 1.0: the tool's "42")
    out, rewards, ran = run(taught, max_turns=2)  # a turn left to read the result: run, and the answer scored
    assert ran == ["12+30", "50-8"] and rewards == [1.0, 1.0]
    assert [m["role"] for m in out[0].messages] == ["assistant", "tool", "assistant"]


def test_c5_7_a_call_whose_results_do_not_fit_is_not_scored(taught):  # noqa: F811 - the fixture
    full, _, _ = run(taught, max_turns=2)
    call_turn = min(len(r.response_ids) - sum(not m for m in r.loss_mask) - len(r.messages[-1]["content"] or "")
                    for r in full)
    out, rewards, _ = run(taught, max_turns=2, max_total_tokens=call_turn + 8)
    assert all(r.info["tool_calls"] == 1 and r.finish_reason == "length" for r in out)
    assert all(r.messages[-1]["role"] == "assistant" and r.messages[-1]["tool_calls"] for r in out)
    assert rewards == [0.0, 0.0]
