"""GRPO's passes (algorithms/grpo_update.py): the tokens a pass computes, and micro-batches sorted
by length where that computes fewer."""

from grpolab.algorithms.grpo_update import fewer_padded_tokens, forward_tokens, pass_tokens


def _sequences(prompt_lengths, response_lengths, prompt_of_row):
    return [([7] * prompt_lengths[p], [8] * r, p) for r, p in zip(response_lengths, prompt_of_row)]


def test_pass_tokens_counts_padding_and_shared_prompts_once():
    seqs = _sequences([5, 9], [3, 10, 4, 1], [0, 0, 1, 1])
    # shared: prompts 5 and 9 padded to 9 (2 x 9) + 4 responses padded to 10 (4 x 10)
    assert pass_tokens(seqs, [[0, 1, 2, 3]], True) == 18 + 40
    # not shared: each row padded to the longest prompt + response (15)
    assert pass_tokens(seqs, [[0, 1, 2, 3]], False) == 4 * 15
    assert pass_tokens(seqs, [[0, 1], [2, 3]], True) == (5 + 2 * 10) + (9 + 2 * 4)
    # real tokens only (no padding): each distinct prompt once when shared
    assert forward_tokens(seqs, [0, 1, 2, 3], True) == 5 + 9 + 18
    assert forward_tokens(seqs, [0, 1, 2, 3], False) == 2 * 5 + 2 * 9 + 18


def test_passes_sorted_by_length_when_that_computes_fewer_tokens():
    # short prompts, each group with one long response: sorting puts the long ones together
    seqs = _sequences([2, 2], [1, 1, 1, 50, 1, 1, 1, 50], [0, 0, 0, 0, 1, 1, 1, 1])
    by_group = [[0, 1, 2, 3], [4, 5, 6, 7]]
    plan = fewer_padded_tokens(seqs, by_group, 4, True)
    assert plan == [[0, 1, 2, 4], [5, 6, 3, 7]]
    assert pass_tokens(seqs, plan, True) == 212 < pass_tokens(seqs, by_group, True) == 404
    # long prompts, even responses: a group per pass stays (its prompt is run once)
    seqs = _sequences([60, 60], [5, 6, 5, 6, 6, 5, 6, 5], [0, 0, 0, 0, 1, 1, 1, 1])
    assert fewer_padded_tokens(seqs, by_group, 4, True) == by_group
