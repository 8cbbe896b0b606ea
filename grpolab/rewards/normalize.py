"""Surface normalisation of answer strings and exact parsing of plain numbers.

Why a whitelist of unit words: a grader that drops *any* word after a number turns "3 million"
into 3 and "2 pi" into 2 — false positives that a policy learns to exploit. Only words that do not
change the value (units, currency, percent, and the counting nouns of the Minerva/CS336
normaliser such as "ways" or "students") are dropped; everything else stays and must match.
Scale words ("3 million") are read as the number they name. Single-letter units ("m", "g", "s")
are dropped only when marked as text (``5 \\text{ m}^2``): a bare ``5 m`` may be ``5m``.

``hedge_words`` finds the words that turn a right number into a non-answer ("not 5", "5 or 6");
the grader refuses an answer with a hedge word that the reference does not have.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_EXPONENT = 400  # 10^400 is exact and cheap; 1e99999 would build a 100k-digit integer

_NUMBER = r"-?(?:\d+(?:\.\d*)?|\.\d+)"
_INT = r"-?\d+"
_NUM_RE = re.compile(rf"^{_NUMBER}$")
_SPACED_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?: \d{3})+(?:\.\d+)?$")
_SLASH_FRAC_RE = re.compile(rf"^({_NUMBER})\s*/\s*({_NUMBER})$")
_LATEX_FRAC_RE = re.compile(r"^(-?)\\frac\s*(?:\{\s*(-?\d+)\s*\}|(\d))\s*(?:\{\s*(-?\d+)\s*\}|(\d))$")
_MIXED_RE = re.compile(r"^(-?)(\d+)\s+(\d+)\s*/\s*(\d+)$")
_MIXED_LATEX_RE = re.compile(r"^(-?)(\d+)\s*\\frac\s*(?:\{\s*(\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))$")
_SCI_E_RE = re.compile(rf"^({_NUMBER})[eE]([+-]?\d{{1,5}})$")
_SCI_TIMES_RE = re.compile(
    rf"^(?:({_NUMBER})\s*(?:\\times|\\cdot|\*|x)\s*)?10\s*(?:\^|\*\*)\s*(?:\{{\s*({_INT})\s*\}}|(\d))$"
)
_SCALES = {"hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_SCALE_RE = re.compile(rf"^({_NUMBER})\s*({'|'.join(_SCALES)})$", re.IGNORECASE)
_ORDINAL_RE = re.compile(r"^(\d+)\s*(?:st|nd|rd|th)$")

# ---------------------------------------------------------------- unit whitelist
UNIT_WORDS = frozenset(
    """
    mm cm km meter metre centimeter centimetre millimeter millimetre kilometer kilometre in inch
    ft foot feet yd yard mile mi acre hectare liter litre ml milliliter millilitre gallon gal quart
    qt pint cup tablespoon tbsp teaspoon tsp ounce oz fl lb lbs pound gram kg kilogram mg milligram
    ton tonne sec second min minute hr hrs hour day week month year yr yrs decade century centuries
    mph kph dollar cent euro usd rupee yen penny pennies nickel dime percent pct percentage degree
    deg radian rad celsius fahrenheit kelvin unit way integer point digit student edge meal multiple
    """.split()
)
# only when written as \text{...}/\mathrm{...}: a bare letter after a number may be a variable
TEXT_ONLY_UNITS = frozenset("m g s h l".split())  # not "k": "5k" is 5000
UNIT_PREFIXES = ("square", "sq", "cubic", "cu")


def _unit_phrase(words: frozenset[str]) -> str:
    word = rf"(?:{'|'.join(sorted(words, key=len, reverse=True))})(?:e?s)?\.?"
    exponent = r"(?:\s*\^\s*(?:\{\s*[23]\s*\}|[23])|[²³])?"
    single = rf"(?:(?:{'|'.join(UNIT_PREFIXES)})\.?\s+)?{word}{exponent}"
    # "km/h", "miles per hour": a single-letter unit is unambiguous in the denominator
    letters = "|".join(sorted(words | TEXT_ONLY_UNITS, key=len, reverse=True))
    denominator = rf"(?:{letters})(?:e?s)?\.?{exponent}"
    return rf"(?:per\s+cent|{single}(?:\s*(?:/|\bper\b)\s*{denominator}|\s+{single})?)"


_ENDS_LIKE_A_VALUE = rf"(.*?(?:[\d}}]|\\pi|\b(?:{'|'.join(_SCALES)})))"  # "3 million dollars" -> "3 million"
_PLAIN_UNIT_RE = re.compile(rf"^{_ENDS_LIKE_A_VALUE}\s*{_unit_phrase(UNIT_WORDS)}$", re.IGNORECASE)
_TEXT_UNIT_RE = re.compile(
    rf"^{_ENDS_LIKE_A_VALUE}\s*\\(?:text|textrm|mathrm|mbox|rm)\s*\{{\s*"
    rf"{_unit_phrase(UNIT_WORDS | TEXT_ONLY_UNITS)}\s*\}}(?:\s*\^\s*(?:\{{\s*[23]\s*\}}|[23]))?$",
    re.IGNORECASE,
)
_TEXT_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mbox|mathbf|textnormal)\s*\{([^{}]*)\}")
_VAR_EQ_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?!=)")
_THOUSANDS_RE = re.compile(r"(?<![\d.])(-?\d{1,3}(?:,\d{3})+)(?![\d])")
_PI_RE = re.compile(r"(?<![\\A-Za-z])pi(?![A-Za-z])")
_LATEX_SPACE_RE = re.compile(r"\\\\|\\[ ,;:!]|~")

# ---------------------------------------------------------------- hedges
HEDGE_WORDS = frozenset(
    """
    not no nor or either neither maybe perhaps possibly probably unless except isn't aren't wasn't
    cannot can't approximately approx roughly about around nearly almost unsure unknown guess
    """.split()
)
HEDGE_COMMANDS = frozenset({"neq", "ne", "approx", "not", "lor", "vee", "sim"})
_COMMAND_RE = re.compile(r"\\([A-Za-z]+)")
_WORD_RE = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
_RUN_RE = re.compile(r"[A-Za-z]+")
_ENV_RE = re.compile(r"\\(?:begin|end)\s*\{[^{}]*\}(?:\{[^{}]*\})?")  # \begin{array}{cc}: no variables


def is_unit_word(word: str) -> bool:
    """True for a whitelisted unit word, singular or plural ("kg", "inches", "dollars")."""
    w = word.lower().rstrip(".")
    return any(x in UNIT_WORDS for x in (w, w[:-1] if w.endswith("s") else w, w[:-2] if w.endswith("es") else w))


def hedge_words(text: str) -> set[str]:
    """The meaning-changing words and symbols in ``text`` ("not", "or", ``\\neq``, "≈"...)."""
    s = str(text).replace("\u2260", "\\neq ").replace("\u2248", "\\approx ")
    found = {f"\\{c}" for c in _COMMAND_RE.findall(s) if c in HEDGE_COMMANDS}
    plain = _COMMAND_RE.sub(" ", s).replace("\u2019", "'")
    found.update(w for w in (m.lower() for m in _WORD_RE.findall(plain)) if w in HEDGE_WORDS)
    return found


def normalize_answer(text: str) -> str:
    """Canonical surface form of an answer: the clean-ups math-verify lacks (``\\text{}`` and unit
    words, thousands separators, ``\\dfrac``, ``$``, percent and degree signs, ``x = 5``, ``pi``,
    unicode minus, trailing period). Words that are not units are kept: they change the answer."""
    s = str(text).strip()
    for old, new in (("\u2212", "-"), ("\u2013", "-"), ("\u00a0", " "), ("\u03c0", "\\pi "), ("\u00d7", "\\times "),
                     ("\u00b7", "\\cdot "), ("\u20ac", ""), ("\u00a3", ""), ("\u00a5", ""), ("\u20b9", "")):
        s = s.replace(old, new)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    # "\\" separates matrix rows and must survive; "\ ", "\,", "~" are spaces, "\!" is none
    s = _LATEX_SPACE_RE.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else ("" if m.group(0) == "\\!" else " "), s)
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s).replace("°", "").replace("\\degree", "")
    s = s.strip()
    unit = _TEXT_UNIT_RE.match(s)
    if unit:
        s = unit.group(1)
    s = _TEXT_RE.sub(r"\1", s).strip()
    s = _VAR_EQ_RE.sub("", s, count=1)
    s = s.strip().rstrip(".").strip()
    s = s.replace("{,}", ",")
    s = _THOUSANDS_RE.sub(lambda m: m.group(1).replace(",", ""), s)
    s = _PI_RE.sub(r"\\pi", s)
    unit = _PLAIN_UNIT_RE.match(s)
    if unit:
        s = unit.group(1)
    return re.sub(r"\s+", " ", s).strip()


def _scientific(mantissa: str | None, exponent: str) -> Fraction | None:
    e = int(exponent)
    if abs(e) > MAX_EXPONENT:
        return None
    return Fraction(mantissa or 1) * Fraction(10) ** e


def parse_number(text: str) -> Fraction | None:
    """A normalised answer as an exact ``Fraction`` when it is one plain number, else None.

    Accepted: integers and decimals (``1 000 000`` with SI spacing), ``a/b``, ``\\frac{a}{b}``,
    mixed numbers (``7 3/4``, ``7\\frac34``: proper fractions only), scientific notation (``1e3``,
    ``1.5 \\times 10^{-3}``), scale words (``3 million``) and ordinals (``5th``).
    """
    s = str(text).strip()
    if s.startswith("+"):
        s = s[1:].lstrip()
    try:
        compact = s.replace(" ", "") if _SPACED_THOUSANDS_RE.match(s) else s
        if _NUM_RE.match(compact):
            return Fraction(compact)
        m = _SLASH_FRAC_RE.match(s)
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den else None
        m = _LATEX_FRAC_RE.match(s)
        if m:
            num, den = int(m.group(2) or m.group(3)), int(m.group(4) or m.group(5))
            return (-1 if m.group(1) else 1) * Fraction(num, den) if den else None
        m = _MIXED_RE.match(s) or _MIXED_LATEX_RE.match(s)
        if m:
            groups = [g for g in m.groups()[1:] if g is not None]
            whole, num, den = (int(g) for g in groups)
            if not 0 < num < den:  # "7 8/4" is no mixed number; "7 3/4" is 7 + 3/4
                return None
            return (-1 if m.group(1) else 1) * (whole + Fraction(num, den))
        m = _SCI_E_RE.match(s)
        if m:
            return _scientific(m.group(1), m.group(2))
        m = _SCI_TIMES_RE.match(s)
        if m:
            return _scientific(m.group(1), m.group(2) or m.group(3))
        m = _SCALE_RE.match(s)
        if m:
            return Fraction(m.group(1)) * _SCALES[m.group(2).lower()]
        m = _ORDINAL_RE.match(s)
        if m:
            return Fraction(int(m.group(1)))
    except (ValueError, ZeroDivisionError):
        return None
    return None


MATH_WORDS = frozenset(
    """
    sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln lg exp sqrt max min gcd lcm mod
    det lim inf sup arg infty infinity
    """.split()
)


def foreign_words(pred: str, gold: str) -> set[str]:
    """Letter runs of ``pred`` (outside LaTeX command names) that ``gold`` cannot account for: not
    a function name, not a run of ``gold``, not made of ``gold``'s variables ("ab" against
    "a^2+b^2" is fine). "5m" or "2\\pi apples" against 5 or 2\\pi: math-verify reads some letters
    as units and drops them, so an answer with a foreign word is refused before it gets there."""
    gold_runs = set(_RUN_RE.findall(_COMMAND_RE.sub(" ", _ENV_RE.sub(" ", gold))))
    gold_letters = set("".join(gold_runs))
    return {
        run for run in _RUN_RE.findall(_COMMAND_RE.sub(" ", _ENV_RE.sub(" ", pred)))
        if run.lower() not in MATH_WORDS and run not in gold_runs and not set(run) <= gold_letters
    }


def is_number_with_words(text: str) -> bool:
    """True for a normalised answer made of numbers and plain words only ("18 apples", "5 and 6",
    "the answer is 5") that is not itself one number. Such an answer is refused unless it equals
    the reference verbatim: math-verify would drop the words and read "18 apples" as 18."""
    tokens = text.split()
    if len(tokens) < 2 or parse_number(text) is not None:
        return False
    numbers = words = 0
    for tok in tokens:
        tok = tok.strip(",.;:")
        if parse_number(tok) is not None:
            numbers += 1
        elif _WORD_RE.fullmatch(tok):
            words += len(tok) > 1
        else:
            return False
    return numbers >= 1 and words >= 1
