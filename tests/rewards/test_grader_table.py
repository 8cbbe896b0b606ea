"""Grader fidelity of ``r1_zero_reward_fn`` and relatives: which answer block counts, unit words
(a whitelist), scale words, matrices, mixed numbers, scientific notation, ``pi``, hedged answers —
both directions — and the false-positive rate on deliberately wrong answers (target 0)."""

import pytest

from grpolab.rewards import (
    UNIT_WORDS,
    extract_r1_zero_answer,
    gsm8k_reward_fn,
    is_equivalent,
    parse_matrix,
    parse_number,
    question_only_reward_fn,
    r1_zero_reward_fn,
    stated_number,
)


def r1(answer: str) -> str:
    return f"reasoning</think> <answer>{answer}</answer>"


P12_34 = "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"

# (category, answer inside the answer block, ground truth, expected answer_reward)
TABLE = [
    # units: dropped only when they are units, currency or percent words
    ("units", "5 dollars", "5", 1), ("units", "\\$5", "5", 1), ("units", "$5.00", "5", 1), ("units", "5 USD", "5", 1),
    ("units", "\u20ac5", "5", 1), ("units", "5 cm", "5", 1), ("units", "5 km", "5", 1), ("units", "12 inches", "12", 1),
    ("units", "3 feet", "3", 1), ("units", "50 percent", "50", 1), ("units", "50 per cent", "50", 1),
    ("units", "50%", "50", 1), ("units", "90 degrees", "90", 1), ("units", "5 seconds", "5", 1),
    ("units", "2 hours", "2", 1), ("units", "12 square feet", "12", 1), ("units", "5 sq ft", "5", 1),
    ("units", "5 km/h", "5", 1), ("units", "60 miles per hour", "60", 1), ("units", "7 kg", "7", 1),
    ("units", "\\frac{1}{2} cup", "1/2", 1), ("units", "10 ways", "10", 1), ("units", "4 students", "4", 1),
    ("units", "3 million", "3", 0), ("units", "2 pi", "2", 0), ("units", "5 apples", "5", 0),
    ("units", "5 times", "5", 0), ("units", "5 squared", "5", 0), ("units", "3 dozen", "3", 0),
    ("units", "5 \\text{ million}", "5", 0), ("units", "5 m", "5", 0), ("units", "2x", "2", 0),
    ("units", "2 x", "2", 0), ("units", "7 hundred", "7", 0),
    # scale words are read as the number they name
    ("scale", "3 million", "3000000", 1), ("scale", "2.5 thousand", "2500", 1),
    ("scale", "3 million dollars", "3000000", 1),
    ("scale", "3 billion", "3000000", 0),
    # \text{} units, with exponents
    ("text units", "5 \\text{ m}^2", "5", 1), ("text units", "5\\text{ cm}^{2}", "5", 1),
    ("text units", "5 \\mathrm{kg}", "5", 1),
    ("text units", "5\\,\\text{m}", "5", 1), ("text units", "5 \\text{ m}^2", "25", 0),
    ("text units", "5 \\text{ apples}", "5", 0),
    # matrices: element-wise in order, any bracket style and spacing; a transpose is wrong
    ("matrix", "\\begin{bmatrix}1 & 2 \\\\ 3 & 4\\end{bmatrix}", P12_34, 1),
    ("matrix", "\\begin{pmatrix} 1 & 2 \\\\\n 3 & 4 \\end{pmatrix}", P12_34, 1),
    ("matrix", "\\left(\\begin{matrix}1&2\\\\3&4\\end{matrix}\\right)", P12_34, 1),
    ("matrix", "\\begin{pmatrix}\\frac12&0.5\\end{pmatrix}", "\\begin{pmatrix}0.5&1/2\\end{pmatrix}", 1),
    ("matrix", "\\begin{pmatrix}2x\\\\-1\\end{pmatrix}", "\\begin{bmatrix}2x\\\\-1\\end{bmatrix}", 1),
    ("matrix", "\\begin{pmatrix}1&3\\\\2&4\\end{pmatrix}", P12_34, 0),
    ("matrix", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1&2\\end{pmatrix}", 0),
    ("matrix", "\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}", P12_34, 0),
    ("matrix", "\\begin{vmatrix}1&2\\\\3&4\\end{vmatrix}", P12_34, 0),
    ("matrix", "\\begin{pmatrix}1&2\\\\3&4\\\\5&6\\end{pmatrix}", P12_34, 0),
    # mixed numbers (proper fractions only), scientific notation
    ("mixed", "7 3/4", "31/4", 1), ("mixed", "7\\frac{3}{4}", "\\frac{31}{4}", 1), ("mixed", "-7 3/4", "-7.75", 1),
    ("mixed", "7 3/4", "21/4", 0), ("mixed", "7 3/4", "73/4", 0), ("mixed", "7 8/4", "9", 0), ("mixed", "2 3", "23", 0),
    ("sci", "1e3", "1000", 1), ("sci", "1.5e-3", "0.0015", 1), ("sci", "1.5 \\times 10^{3}", "1500", 1),
    ("sci", "2 \\cdot 10^{-2}", "0.02", 1), ("sci", "1E6", "1000000", 1),
    ("sci", "1e3", "13", 0), ("sci", "1e3", "100", 0),
    ("sci", "1e99999", "1", 0),
    # pi without a backslash
    ("pi", "36pi", "36\\pi", 1), ("pi", "36 pi", "36\\pi", 1),
    ("pi", "36\\pi", "36pi", 1), ("pi", "\u03c0/2", "\\frac{\\pi}{2}", 1),
    ("pi", "36pi", "36", 0), ("pi", "3.14", "\\pi", 0), ("pi", "pi", "3.14159", 0),
    # hedged answers get no credit
    ("hedge", "5 is not the answer", "5", 0), ("hedge", "5 or 6", "5", 0), ("hedge", "5 or 6", "6", 0),
    ("hedge", "not 5", "5", 0), ("hedge", "either 5 or 6", "6", 0), ("hedge", "\\boxed{5} or \\boxed{6}", "6", 0),
    ("hedge", "5 \\neq 6", "5", 0), ("hedge", "approximately 5", "5", 0), ("hedge", "x = 5 or x = 6", "5", 0),
    ("hedge", "5 \\text{ or } 6", "5", 0), ("hedge", "maybe 5", "5", 0), ("hedge", "5 and 6", "5", 0),
    ("hedge", "the answer is 5", "5", 0), ("hedge", "\\text{No}", "No", 1),
    ("hedge", "\\text{not possible}", "not possible", 1),
    # ordinals, SI spacing
    ("misc", "5th", "5", 1), ("misc", "1 000 000", "1000000", 1), ("misc", "5, 6", "5", 0),
]


@pytest.mark.parametrize("category,answer,gold,expected", TABLE, ids=[f"{c}:{a}|{g}" for c, a, g, _ in TABLE])
def test_grader_table(category, answer, gold, expected):
    out = r1_zero_reward_fn(r1(answer), gold)
    assert out["format_reward"] == 1.0
    assert out["answer_reward"] == expected, (category, answer, gold)


def test_table_is_large_and_two_sided():
    from collections import Counter

    assert len(TABLE) >= 60
    both = Counter((c, e) for c, _, _, e in TABLE)
    for category in {c for c, *_ in TABLE} - {"scale", "misc"}:
        assert both[(category, 0)] >= 1, category  # every category has a must-reject case


def test_unit_whitelist_excludes_value_changing_words():
    for word in ("million", "thousand", "pi", "times", "squared", "dozen", "or", "not", "x"):
        assert word not in UNIT_WORDS


# ---------------------------------------------------------------- which answer block counts
@pytest.mark.parametrize(
    "response,expected",
    [
        ("r</think> <answer>3</answer> wait, recheck <answer>5</answer>", "5"),
        ("r</think> <answer>3</answer><answer>5</answer><|im_end|>", "5"),
        ("r</think> <answer>5</answer> and then 7", "5"),
        ("r</think> <answer>3</answer> hmm <answer>5", None),  # the final revision is unfinished
        ("<answer>9</answer> r</think> <answer>5</answer>", "5"),
    ],
)
def test_the_last_answer_block_counts(response, expected):
    assert extract_r1_zero_answer(response) == expected
    assert r1_zero_reward_fn(response, "5")["reward"] == float(expected == "5")
    assert r1_zero_reward_fn(response, "3")["reward"] == 0.0


def test_lenient_and_gsm8k_use_the_last_block_too():
    response = "r</think>\n<answer>3</answer> no wait <answer>5</answer>"
    assert r1_zero_reward_fn(response, "5", lenient_format=True)["reward"] == 1.0
    assert gsm8k_reward_fn(response, "5")["reward"] == 1.0 and gsm8k_reward_fn(response, "3")["reward"] == 0.0


def test_gsm8k_last_number_reading_refuses_value_changing_tails():
    assert gsm8k_reward_fn("</think> <answer>She has 18 apples</answer>", "18")["reward"] == 1.0
    assert gsm8k_reward_fn("</think> <answer>3 million</answer>", "3")["reward"] == 0.0
    assert gsm8k_reward_fn("</think> <answer>3 million</answer>", "3000000")["reward"] == 1.0
    assert gsm8k_reward_fn("</think> <answer>2 pi</answer>", "2")["reward"] == 0.0
    assert gsm8k_reward_fn("</think> <answer>5 or 6</answer>", "6")["reward"] == 0.0
    assert gsm8k_reward_fn("#### not 18", "18")["reward"] == 0.0


@pytest.mark.parametrize(
    "text,gold,expected",
    [
        ("the answer is 3 million.", "3", 0), ("the answer is 3 million.", "3000000", 1), ("so 2\\pi", "2", 0),
        ("it is 2 pi", "2", 0), ("so 2x", "2", 0), ("we get 2^3", "2", 0), ("so 2 \\times 10^3", "10", 0),
        ("it weighs 18kg.", "18", 1), ("the answer is 50\\%", "50", 1), ("the answer is $5$.", "5", 1),
        ("total 1,234 apples", "1234", 1),
    ],
)
def test_free_text_last_number_keeps_what_changes_its_value(text, gold, expected):
    assert question_only_reward_fn(text, gold)["reward"] == expected
    assert gsm8k_reward_fn(text, gold)["reward"] == expected


def test_stated_number():
    assert stated_number("so 1,234 sheep") == "1,234" and stated_number("3 billion") == "3 billion"
    assert stated_number("2\\pi") is None and stated_number("no numbers") is None


def test_parsers_directly():
    from fractions import Fraction

    assert parse_number("7 3/4") == Fraction(31, 4) and parse_number("-7\\frac34") == Fraction(-31, 4)
    assert parse_number("1.5e-3") == Fraction(3, 2000) and parse_number("10^{3}") == 1000
    assert parse_number("3 million") == 3_000_000 and parse_number("1e9999") is None
    assert parse_number("7 8/4") is None and parse_number("2 3") is None
    assert parse_matrix("\\begin{bmatrix}1&2\\\\3&4\\\\\\end{bmatrix}") == (("1", "2"), ("3", "4"))
    assert parse_matrix("\\begin{pmatrix}1&2\\\\3\\end{pmatrix}") is None  # ragged
    assert parse_matrix("\\begin{vmatrix}1\\end{vmatrix}") is None


# ---------------------------------------------------------------- false-positive rate
FP_GOLDS = ["5", "18", "0.5", "\\frac{3}{4}", "1000", "-3", "12", "2\\pi", "31/4", P12_34]


def deliberately_wrong(gold: str) -> list[str]:
    """Answers that contain or resemble ``gold`` but state something else."""
    wrong = [f"{gold} is not the answer", f"not {gold}", f"{gold} or 7", f"either {gold} or 7", f"7 or {gold}",
             f"\\boxed{{7}} or \\boxed{{{gold}}}", f"{gold} \\neq 7", f"approximately {gold}", f"maybe {gold}",
             f"{gold} and 7", f"{gold} million", f"{gold} thousand", f"{gold} pi", f"{gold}x", f"{gold} m",
             f"{gold} apples", f"{gold} squared", f"{gold} times 2", f"-({gold})", f"2 {gold}", f"{gold}^2",
             f"{gold} + 1", f"10 \\cdot {gold}", f"\\sqrt{{{gold}}}"]
    number = parse_number(gold)
    if number is not None:
        wrong += [str(number + 1), str(number * 10), str(-number) if number else "1", f"{float(number) + 0.001}",
                  f"{number}e1", f"{number} \\times 10^{{2}}", f"1 {number}" if number > 0 else "1 3/4"]
    return wrong


def false_positive_rate() -> tuple[float, list]:
    accepted, total = [], 0
    for gold in FP_GOLDS:
        for answer in deliberately_wrong(gold):
            total += 1
            if r1_zero_reward_fn(r1(answer), gold)["reward"] != 0.0:
                accepted.append((answer, gold))
    matrices = [("\\begin{pmatrix}1&3\\\\2&4\\end{pmatrix}", P12_34), ("\\begin{pmatrix}1&2\\end{pmatrix}", P12_34),
                ("\\begin{pmatrix}4&3\\\\2&1\\end{pmatrix}", P12_34), ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "(1,2)")]
    for answer, gold in matrices:
        total += 1
        if r1_zero_reward_fn(r1(answer), gold)["reward"] != 0.0:
            accepted.append((answer, gold))
    # a right first answer revised to a wrong one
    for gold in FP_GOLDS:
        total += 1
        if r1_zero_reward_fn(f"r</think> <answer>{gold}</answer> no: <answer>0.123</answer>", gold)["reward"] != 0.0:
            accepted.append(("first block right, last wrong", gold))
    return len(accepted) / total, accepted, total


def test_false_positive_rate_on_deliberately_wrong_answers_is_zero():
    rate, accepted, total = false_positive_rate()
    print(f"\nfalse-positive rate: {rate:.4f} ({len(accepted)} of {total} deliberately wrong answers accepted)")
    assert total >= 300
    assert accepted == [] and rate == 0.0


def test_right_answers_in_the_same_shapes_are_still_accepted():
    """The guard against the false positives above must not reject the plain right answer."""
    for gold in FP_GOLDS:
        assert r1_zero_reward_fn(r1(gold), gold)["reward"] == 1.0, gold
        assert r1_zero_reward_fn(r1(f"\\boxed{{{gold}}}"), gold)["reward"] == 1.0, gold
    assert is_equivalent("x = 31/4", "7 3/4") and is_equivalent("0.75", "\\frac34")
