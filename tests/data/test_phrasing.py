"""The arithmetic task's ``phrasing``: a words question is its compact question reworded, with the
same answer, worked solution and split."""

import pytest

from grpolab.data import get_task, split_of
from grpolab.data.tasks.arithmetic import in_words


def test_in_words():
    assert in_words("3+4-2") == "What is 3 + 4 - 2?"
    assert in_words("12*3-45") == "What is 12 * 3 - 45?"


@pytest.mark.parametrize("split", ["train", "validation", "test"])
@pytest.mark.parametrize("options", [{}, {"num_ops": 1, "digits": 2, "ops": "+-*"}, {"wrong_fraction": 0.5}])
def test_words_match_compact(split, options):
    compact = get_task("arithmetic", seed=3, **options).examples(split, 40)
    words = get_task("arithmetic", seed=3, phrasing="words", **options).examples(split, 40)
    for c, w in zip(compact, words, strict=True):
        assert w.question == in_words(c.question)
        assert w.meta["compact_question"] == c.question
        assert (w.answer, w.solution, w.meta["source"], w.meta["split"]) == (c.answer, c.solution, c.meta["source"],
                                                                             split)
        assert split_of(c.question) == split
    assert words[0].question.startswith("What is ") and words[0].question.endswith("?")


def test_compact_is_default_and_unchanged():
    task = get_task("arithmetic")
    assert task.phrasing == "compact"
    assert all("compact_question" not in e.meta and "What" not in e.question for e in task.examples("train", 20))


def test_unknown_phrasing_refused():
    with pytest.raises(ValueError, match="phrasing"):
        get_task("arithmetic", phrasing="prose")
