"""Verifiers: table-driven grading cases, formats, adversarial answers, custom and weighted rewards."""

import threading
import time
from pathlib import Path

import pytest

from grpolab.rewards import (
    RewardComponent,
    RewardScorer,
    WeightedReward,
    arithmetic_reward_fn,
    build_reward,
    countdown_reward_fn,
    evaluate_equation,
    get_reward_fn,
    gsm8k_reward_fn,
    is_equivalent,
    question_only_reward_fn,
    r1_zero_reward_fn,
)

GSM8K_TEST = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


def r1(answer: str) -> str:
    return f"some reasoning</think> <answer>{answer}</answer>"


# (model answer inside the answer block, ground truth, expected answer_reward)
CASES = [
    ("0.5", "1/2", 1), ("1/2", "0.5", 1), ("\\frac{1}{2}", "0.5", 1), ("\\dfrac12", "1/2", 1),
    ("\\tfrac{1}{2}", "\\frac12", 1), ("\\frac{2}{4}", "1/2", 1), ("0.50", "0.5", 1), (".5", "0.5", 1),
    ("1,000", "1000", 1), ("1000", "1,000", 1), ("1{,}000", "1000", 1), ("12,345,678", "12345678", 1),
    ("5 \\text{ cm}", "5", 1), ("5\\text{cm}", "5", 1), ("5 cm", "5", 1), ("18 dollars", "18", 1),
    ("x=5", "5", 1), ("x = 5", "5", 1), ("y=-3", "-3", 1), ("\\$18", "18", 1), ("$18$", "18", 1),
    ("18.", "18", 1), ("50\\%", "50", 1), ("50%", "50", 1), ("90^\\circ", "90", 1), ("90^{\\circ}", "90", 1),
    ("90°", "90", 1), ("\u22123", "-3", 1), ("-3", "-3", 1), ("-0.25", "-1/4", 1), ("+7", "7", 1),
    ("2x+3", "3+2x", 1), ("x^2+2x+1", "(x+1)^2", 1), ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", 1),
    ("(1,2]", "(1,2]", 1), ("[0, \\infty)", "[0,\\infty)", 1), ("(1, 2)", "(1,2)", 1),
    ("\\left(1, 2\\right)", "(1,2)", 1), ("\\boxed{42}", "42", 1), ("\\boxed{\\frac{3}{4}}", "0.75", 1),
    ("\\text{Monday}", "Monday", 1), ("\\pi", "\\pi", 1), ("2\\pi", "2 \\pi", 1), ("10^{3}", "1000", 1),
    ("3.14", "3.14", 1),
    # wrong answers, near misses
    ("(1,2)", "(1,2]", 0), ("[1,2]", "(1,2)", 0), ("(2, 1)", "(1,2)", 0), ("7", "8", 0), ("1001", "1000", 0),
    ("0.49", "1/2", 0), ("-5", "5", 0), ("5", "-5", 0), ("2x+4", "2x+3", 0), ("x^2", "x^3", 0),
    ("1,001", "1000", 0), ("17.99", "18", 0), ("\\frac{1}{3}", "0.33", 0), ("3.15", "3.14", 0),
    ("Tuesday", "Monday", 0), ("", "5", 0), ("   ", "5", 0), ("no idea", "5", 0), ("5/0", "5", 0),
    ("\\boxed{}", "5", 0), ("12", "1.2", 0), ("100", "10", 0),
]


@pytest.mark.parametrize("answer,gold,expected", CASES)
def test_grading_table(answer, gold, expected):
    out = r1_zero_reward_fn(r1(answer), gold)
    assert out["format_reward"] == 1.0
    assert out["answer_reward"] == expected, (answer, gold)
    assert out["reward"] == expected


def test_there_are_at_least_60_cases():
    assert len(CASES) >= 60


@pytest.mark.parametrize(
    "response,fmt",
    [
        ("r</think> <answer>5</answer>", 1),
        ("r</think><answer>5</answer>", 0),  # strict: exactly one space
        ("r</think>  <answer>5</answer>", 0),
        ("r</think>\n<answer>5</answer>", 0),
        ("r</think> <answer>5", 0),  # no closing tag
        ("r <answer>5</answer>", 0),  # no </think>
        ("r</answer></think> <answer>5", 0),  # the closing tag must come after
        ("", 0),
        ("r</think> <answer>5</answer><|im_end|>", 1),  # text after </answer> ignored
        ("r</think> <answer>5</answer> and then 7", 1),
    ],
)
def test_r1_zero_format_rules(response, fmt):
    out = r1_zero_reward_fn(response, "5")
    assert out["format_reward"] == fmt
    assert out["reward"] == fmt  # the answer is right whenever the format is
    if not fmt:
        assert out == {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}


def test_lenient_format_accepts_any_whitespace():
    for sep in ("", "  ", "\n", "\n\n "):
        out = r1_zero_reward_fn(f"r</think>{sep}<answer>5</answer>", "5", lenient_format=True)
        assert out["reward"] == 1.0
    assert get_reward_fn("r1_zero_lenient")("r</think>\n<answer>5</answer>", "5")["reward"] == 1.0


def test_multiple_and_numeric_ground_truths():
    assert r1_zero_reward_fn(r1("0.5"), ["1/3", "1/2"])["reward"] == 1.0
    assert r1_zero_reward_fn(r1("0.5"), ["1/3", "2"])["reward"] == 0.0
    assert r1_zero_reward_fn(r1("18"), 18)["reward"] == 1.0
    assert r1_zero_reward_fn(r1("2.5"), 2.5)["reward"] == 1.0


@pytest.mark.parametrize(
    "answer",
    ["9**9**9", "9^{9^{9}}", "1" * 30000, "{" * 600 + "1" + "}" * 600, "\\frac{" * 300 + "1" + "}{2}" * 300],
)
def test_adversarial_answers_finish_and_score_zero(answer):
    out = r1_zero_reward_fn(r1(answer), "5", timeout=2.0)  # returns at all: cut at the timeout if slow
    assert out["answer_reward"] == 0.0


def test_grading_works_off_the_main_thread():
    results = []
    t = threading.Thread(target=lambda: results.append(
        (is_equivalent("2x+3", "3+2x"), r1_zero_reward_fn(r1("9^{9^{9}}"), "5", timeout=1.0)["reward"])))
    t.start()
    t.join(30)
    assert results == [(True, 0.0)]


def test_question_only_and_gsm8k_rewards():
    assert question_only_reward_fn("so it is \\boxed{12}. Also 7", "12")["reward"] == 1.0
    assert question_only_reward_fn("the answer is 1,234", "1234")["reward"] == 1.0
    assert question_only_reward_fn("no numbers", "1")["reward"] == 0.0
    assert gsm8k_reward_fn("She makes 9 * 2 = 18.\n#### 18", "18")["reward"] == 1.0
    assert gsm8k_reward_fn("</think> <answer>$18</answer>", "18")["reward"] == 1.0
    assert gsm8k_reward_fn("the answer is 17", "18")["reward"] == 0.0
    assert gsm8k_reward_fn("nothing here", "18") == {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}


def test_arithmetic_and_countdown_verifiers():
    assert arithmetic_reward_fn(r1("-9"), "-9")["reward"] == 1.0
    assert arithmetic_reward_fn(r1(" 6 "), "6")["reward"] == 1.0
    assert arithmetic_reward_fn(r1("6.0"), "6")["reward"] == 0.0
    assert arithmetic_reward_fn("6", "6")["format_reward"] == 0.0
    gt = {"numbers": [3, 5, 2], "target": 13}
    assert countdown_reward_fn(r1("3*5-2"), gt)["reward"] == 1.0
    assert countdown_reward_fn(r1("(5*3)-2 = 13"), gt)["reward"] == 1.0
    assert countdown_reward_fn(r1("5*3-2-0"), gt)["reward"] == 0.0  # 0 is not given
    assert countdown_reward_fn(r1("5*5-2*6"), gt)["reward"] == 0.0  # 5 used twice
    assert countdown_reward_fn(r1("5*3-2+2-2"), gt)["reward"] == 0.0
    assert countdown_reward_fn(r1("13"), {"numbers": [13], "target": 13})["reward"] == 1.0
    assert countdown_reward_fn(r1("(3+5)/2"), {"numbers": [3, 5, 2], "target": 4})["reward"] == 1.0
    assert countdown_reward_fn(r1("3/2*2"), {"numbers": [3, 2, 2], "target": 3})["reward"] == 1.0  # exact fractions
    for hostile in ("__import__('os').system('true')", "9**9**9", "3//2", "-3+16", "open('x')", "1" * 500,
                    "2*" * 150 + "2"):
        assert countdown_reward_fn(r1(hostile), gt)["reward"] == 0.0
    assert evaluate_equation("(1+2)*3") is not None and evaluate_equation("x+1") is None


# ---------------------------------------------------------------- custom, weighted, safe scoring
def my_domain_reward(response, ground_truth):
    return {"reward": float("legal" in response)}


def raising_reward(response, ground_truth):
    raise RuntimeError("boom")


def nan_reward(response, ground_truth):
    return {"reward": float("nan")}


def string_reward(response, ground_truth):
    return {"reward": "high"}


def hanging_reward(response, ground_truth):
    if response == "hang":
        time.sleep(5)
    return {"reward": 1.0}


def test_custom_reward_by_import_path():
    fn = get_reward_fn("tests.rewards.test_rewards:my_domain_reward")
    assert fn("legal text", None)["reward"] == 1.0
    with pytest.raises(ValueError, match="no function"):
        get_reward_fn("tests.rewards.test_rewards:missing")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward_fn("r2_zero")


def test_weighted_reward_logs_each_component():
    fn = WeightedReward(
        [RewardComponent("r1_zero", 0.1, "format_reward"), RewardComponent("r1_zero", 1.0, "answer_reward")]
    )
    out = fn(r1("4"), "5")
    assert out["reward"] == pytest.approx(0.1)
    assert out["r1_zero.format_reward"] == 1.0 and out["r1_zero.answer_reward"] == 0.0
    assert out["format_reward"] == 1.0 and out["answer_reward"] == 0.0
    assert fn(r1("5"), "5")["reward"] == pytest.approx(1.1)
    built = build_reward([{"fn": "tests.rewards.test_rewards:my_domain_reward", "weight": 2.0, "name": "domain"},
                          {"fn": "r1_zero", "weight": 1.0}])
    out = built("legal</think> <answer>5</answer>", "5")
    assert out["reward"] == 3.0 and out["domain"] == 1.0


@pytest.mark.slow  # make test-slow (test-all), not make test: minutes of real processes
def test_reward_scorer_failures_score_zero_and_are_counted():
    for fn in (raising_reward, nan_reward, string_reward):
        scorer = RewardScorer(fn, timeout_s=5.0)
        assert (
            scorer.score(["a", "b"], [None, None]) == [{"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}] * 2
        )
        assert scorer.errors == 2
        scorer.close()
    scorer = RewardScorer(hanging_reward, timeout_s=0.5)
    out = scorer.score(["ok", "hang", "ok"], [None] * 3)
    # the hanging call was cut at its timeout (had the scorer waited the 5 s out, it would score 1.0
    # and count no timeout): no wall-clock bound, which a busy machine breaks
    assert [o["reward"] for o in out] == [1.0, 0.0, 1.0]
    assert scorer.timeouts == 1 and scorer.errors == 1
    scorer.close()


def test_reward_scorer_process_pool():
    scorer = RewardScorer(get_reward_fn("arithmetic"), timeout_s=60.0, num_workers=2)
    out = scorer.score([r1("3"), r1("4")], ["3", "3"])
    assert [o["reward"] for o in out] == [1.0, 0.0]
    scorer.close()


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason="shared GSM8K data not present")
def test_every_gsm8k_reference_solution_grades_correct():
    from grpolab.data import load_gsm8k

    examples = load_gsm8k(GSM8K_TEST)
    assert len(examples) > 1000
    for ex in examples:
        assert r1_zero_reward_fn(ex.solution, ex.answer)["reward"] == 1.0, ex.question
        perturbed = str(int(float(ex.answer)) + 1) if float(ex.answer).is_integer() else ex.answer + "1"
        assert r1_zero_reward_fn(ex.solution, perturbed)["reward"] == 0.0, ex.question
