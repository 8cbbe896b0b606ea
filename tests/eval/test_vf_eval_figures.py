"""C5-6: ``evaluate``'s figures for a verifiers rubric. verifiers has no accuracy: a response is right
when the rubric's answer function (the largest weight) reaches 1, ``eval/accuracy`` is the share of
such responses (not the mean weighted reward), ``eval/format_rate`` the parser's format function's
mean (left out when the rubric has none); ``reward`` and each ``vf/<function>`` are reported."""

from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="the verifiers extra is not installed (pip install -e '.[envs]')")

from grpolab.data.tasks.vf import VerifiersTask  # noqa: E402
from grpolab.eval import evaluate  # noqa: E402
from grpolab.eval.evaluation import rubric_roles  # noqa: E402
from grpolab.models import load_model_and_tokenizer  # noqa: E402
from grpolab.rewards.vf_reward import VfRubric  # noqa: E402
from grpolab.rollout import SamplingParams  # noqa: E402
from tests.eval.test_eval import _Scripted, _Template  # noqa: E402

HERE = Path(__file__).parents[1] / "envs" / "vf_envs"
WEIGHTED, SUM = str(HERE / "weighted_format_env.py"), str(HERE / "sum_env.py")


def _evaluate(spec, responses):
    _, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    examples = VerifiersTask(spec).examples("train", len(responses))
    backend = _Scripted(tok, [[r] for r in responses])
    return evaluate(backend, examples, _Template(), VfRubric(spec), SamplingParams(max_tokens=8), n=1,
                    reward_timeout_s=60)


def test_c5_6_the_answer_function_and_the_parsers_format_function_are_found():
    assert rubric_roles(WEIGHTED) == ("correct", "format_reward_func")
    assert rubric_roles(SUM) == ("correct_answer", None)  # weights 1.0 and 0.1; no parser format function


def test_c5_6_accuracy_is_the_share_right_and_the_format_rate_the_parsers():
    out = _evaluate(WEIGHTED, ["<answer>42</answer>", "<answer>41</answer>", "I think it is 41, or 40"])
    rewards = [s["reward"] for s in out.scores]
    assert rewards[0] > 1 and 0 < rewards[2] < rewards[1] < 1  # 1.7, 0.7, 0.5 + 0.2 x its format score
    m = out.metrics
    assert out.correct == [True, False, False]
    assert m["accuracy"] == pytest.approx(1 / 3)  # was the mean weighted reward (> 0.9 here)
    fmt = [s["vf/format_reward_func"] for s in out.scores]
    assert m["format_rate"] == pytest.approx(sum(fmt) / 3) and m["format_rate"] > 0  # was 0.0
    assert m["reward"] == pytest.approx(sum(rewards) / 3)
    assert m["vf/correct"] == pytest.approx(1 / 3) and m["vf/short"] == 1.0


def test_c5_6_without_a_format_function_the_format_rate_is_left_out():
    examples = VerifiersTask(SUM).examples("train", 3)
    right = [e.answer["row"]["answer"] for e in examples]
    out = _evaluate(SUM, [right[0], str(int(right[1]) + 1), f"the answer is {right[2]}"])  # 1.1, 0.1, 1.0
    assert [s["reward"] for s in out.scores] == pytest.approx([1.1, 0.1, 1.0])
    assert out.metrics["accuracy"] == pytest.approx(2 / 3)  # was (1.1 + 0.1 + 1.0) / 3
    assert "format_rate" not in out.metrics  # was 0.0
    assert out.metrics["vf/short_answer"] == pytest.approx(2 / 3)
