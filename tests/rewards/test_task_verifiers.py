"""The embedded tasks' verifiers read an integer as ``r1_zero`` does — plain ASCII digits with an
optional sign, not Python's literal spellings — and Countdown checks a stated right-hand side."""

from __future__ import annotations

import pytest

from grpolab.rewards import BUILTIN_REWARDS
from grpolab.rewards.tasks import arithmetic_reward_fn, countdown_reward_fn, evaluate_equation, plain_integer


def r1(answer: str, space: str = " ") -> str:
    return f"3+7=10</think>{space}<answer>{answer}</answer>"


LITERALS = ["1_0", "0x0a", "0o12", "\uff11\uff10", "\u0661\u0660", "10.0", "1e1", "+ 10", "ten"]


@pytest.mark.parametrize("answer", LITERALS)
@pytest.mark.parametrize("name", ["arithmetic", "arithmetic_lenient"])
def test_python_literal_spellings_of_an_integer_are_wrong(answer, name):
    for space in (" ", "\n"):  # strict and lenient formats
        score = BUILTIN_REWARDS[name](r1(answer, space), "10")
        assert score["reward"] == 0.0 and score["answer_reward"] == 0.0, (answer, space)
    if answer == "1_0":
        assert BUILTIN_REWARDS["r1_zero"](r1(answer), "10")["reward"] == 0.0  # the two verifiers agree


@pytest.mark.parametrize("answer,truth", [("10", "10"), (" 10 ", "10"), ("+10", "10"), ("010", "10"),
                                          ("-7", "-7"), ("\u22127", "-7")])
def test_plain_integers_with_a_sign_and_spaces_are_read(answer, truth):
    assert arithmetic_reward_fn(r1(answer), truth)["reward"] == 1.0
    assert plain_integer(answer) == int(truth)


GT = {"numbers": [3, 5, 2], "target": 13}


@pytest.mark.parametrize("equation,reward", [
    ("3*5-2 = 99", 0.0),  # a false stated value is wrong, though the left side reaches the target
    ("3*5-2 = 13", 1.0),
    ("3*5-2=13", 1.0),
    ("3*5-2 = 13 = 13", 0.0),
    ("3*5-2 =", 0.0),
    ("= 13", 0.0),
    ("3*5-2 = 13.0", 0.0),
    ("3*5-0x2", 0.0),  # Python literal spellings of a given number
    ("3*5-2_0", 0.0),
    ("\uff13*5-2", 0.0),
])
def test_countdown_checks_the_right_hand_side_and_plain_numbers(equation, reward):
    assert countdown_reward_fn(r1(equation), GT)["reward"] == reward, equation


def test_an_equation_stating_a_value_evaluates_only_when_it_is_the_left_sides():
    assert evaluate_equation("(5*3)-2 = 13")[0] == 13
    assert evaluate_equation("(5*3)-2 = 12") is None


def test_an_answer_past_pythons_int_digit_limit_is_wrong_not_an_error():
    # T08: int() of a 5000-digit answer raised ValueError (Python's 4300-digit limit): a reward failure
    huge = "9" * 5000
    for answer in (huge, "-" + huge):
        assert arithmetic_reward_fn(r1(answer), "10") == arithmetic_reward_fn(r1("11"), "10")
        assert arithmetic_reward_fn(r1(answer), "10")["reward"] == 0.0
        assert plain_integer(answer) is None
    assert plain_integer("0" * 5000 + "10") == 10  # leading zeros are not digits of the number
    assert countdown_reward_fn(r1(f"3*5-2 = {huge}"), GT)["reward"] == 0.0
    assert countdown_reward_fn(r1(huge), GT)["reward"] == 0.0
