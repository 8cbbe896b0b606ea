"""grpolab.training.batching: micro-batch planning, row selection, optimizer batches, the example sampler."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.training.batching import ExampleSampler, optimizer_batches, plan_microbatches, take_rows


# ---------------------------------------------------------------- plan_microbatches
def test_plan_microbatches_equal_consecutive_slices():
    assert plan_microbatches([3] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan_microbatches([3] * 8, 1) == [list(range(8))]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12))
def test_plan_microbatches_uneven_split_differs_by_at_most_one_row(n, accumulation):
    plans = plan_microbatches([1] * n, accumulation)
    sizes = [len(p) for p in plans]
    assert [i for p in plans for i in p] == list(range(n))  # consecutive, every row exactly once
    assert len(plans) == min(n, accumulation) and min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1


def test_plan_microbatches_uneven_hand_case():
    assert plan_microbatches([1] * 10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert plan_microbatches([1] * 2, 4) == [[0], [1]]  # fewer rows than micro-batches: no empty ones


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 200))
def test_token_budget_packing_never_exceeds_the_budget_unless_one_row_does(lengths, budget):
    plans = plan_microbatches(lengths, 3, token_budget=budget)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))  # every row exactly once
    for p in plans:
        assert p, "no empty micro-batch"
        padded = len(p) * max(lengths[i] for i in p)
        assert padded <= budget or len(p) == 1, (p, padded, budget)


def test_token_budget_packs_short_rows_together():
    lengths = [10, 2, 2, 10, 2, 2]
    plans = plan_microbatches(lengths, 6, token_budget=8)
    assert plans == [[1, 2, 4, 5], [0], [3]]  # sorted by length; 4 x 2 = 8 fits, 10 alone exceeds
    assert plan_microbatches([100], 1, token_budget=8) == [[0]]  # a row longer than the budget goes alone


# ---------------------------------------------------------------- take_rows
def _padded_batch():
    # 3 rows right-padded to 6 positions; responses end at label positions 2, 5 and 3
    mask = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    ids = torch.arange(18).view(3, 6)
    return {"input_ids": ids, "labels": ids + 100, "response_mask": mask,
            "advantages": torch.tensor([[1.0], [2.0], [3.0]]), "raw": torch.tensor([7.0, 8.0, 9.0]),
            "name": "not a tensor"}


def test_take_rows_trims_the_common_right_padding():
    batch = _padded_batch()
    out = take_rows(batch, [0, 2], "cpu")
    assert out["input_ids"].shape == (2, 4)  # row 2's last response token is at position 3
    assert torch.equal(out["input_ids"], batch["input_ids"][[0, 2], :4])
    assert torch.equal(out["labels"], batch["labels"][[0, 2], :4])
    assert torch.equal(out["response_mask"], batch["response_mask"][[0, 2], :4])
    assert torch.equal(out["advantages"], torch.tensor([[1.0], [3.0]]))  # per-row (B, 1) tensors just selected
    assert torch.equal(out["raw"], torch.tensor([7.0, 9.0]))
    assert "name" not in out
    assert take_rows(batch, [0], "cpu")["input_ids"].shape == (1, 3)
    assert take_rows(batch, [1, 0], "cpu")["input_ids"].shape == (2, 6)  # nothing to trim
    assert torch.equal(take_rows(batch, [1, 0], "cpu")["input_ids"], batch["input_ids"][[1, 0]])


def test_take_rows_without_response_tokens_keeps_one_column():
    batch = _padded_batch()
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    assert take_rows(batch, [0, 1], "cpu")["input_ids"].shape == (2, 1)


# ---------------------------------------------------------------- optimizer_batches
def test_optimizer_batches_without_shuffle_are_consecutive():
    assert optimizer_batches(10, 4, shuffle=False) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # keep_together is only an ordering within shuffled batches: unshuffled batches stay consecutive
    assert optimizer_batches(6, 3, shuffle=False, keep_together=[1, 0, 1, 0, 1, 0]) == [[0, 1, 2], [3, 4, 5]]


def test_shuffled_optimizer_batches_are_a_permutation_that_differs_across_epochs():
    g = torch.Generator().manual_seed(0)
    epochs = [optimizer_batches(16, 4, shuffle=True, generator=g) for _ in range(3)]
    for batches in epochs:
        assert [len(b) for b in batches] == [4, 4, 4, 4]
        assert sorted(r for b in batches for r in b) == list(range(16))
    # the same generator, called again for the next epoch, gives different optimizer batches
    as_sets = [[frozenset(b) for b in batches] for batches in epochs]
    assert as_sets[0] != as_sets[1] and as_sets[1] != as_sets[2]
    # and the sequence is reproducible from the seed
    g2 = torch.Generator().manual_seed(0)
    assert [optimizer_batches(16, 4, shuffle=True, generator=g2) for _ in range(3)] == epochs


def test_keep_together_keeps_same_prompt_rows_adjacent_within_a_batch():
    prompt_of = [r // 4 for r in range(32)]  # 8 prompts x 4 responses
    g, twin = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(5):
        plain = optimizer_batches(32, 8, shuffle=True, generator=twin)
        grouped = optimizer_batches(32, 8, shuffle=True, generator=g, keep_together=prompt_of)
        # the same rows per batch as without keep_together (it only orders rows inside a batch) ...
        assert [sorted(b) for b in grouped] == [sorted(b) for b in plain]
        for batch in grouped:
            prompts = [prompt_of[r] for r in batch]
            # ... and each prompt's rows form one contiguous run
            runs = [p for i, p in enumerate(prompts) if i == 0 or prompts[i - 1] != p]
            assert len(runs) == len(set(prompts)), prompts


# ---------------------------------------------------------------- ExampleSampler
def test_example_sampler_covers_each_epoch_and_reshuffles():
    s = ExampleSampler(10, seed=3)
    first, second = s.next(10), s.next(10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first != second  # a new permutation every pass
    assert s.state_dict() == {"epoch": 1, "position": 10}
    assert ExampleSampler(10, seed=3).next(10) == first  # seeded
    assert ExampleSampler(10, seed=4).next(10) != first


def test_example_sampler_crosses_epoch_boundaries():
    s = ExampleSampler(4, seed=0)
    reference = ExampleSampler(4, seed=0)
    whole = reference.next(4) + reference.next(4)
    assert s.next(3) + s.next(3) + s.next(2) == whole
    assert len(ExampleSampler(3, seed=0).next(7)) == 7


def test_example_sampler_state_round_trip_resumes_the_same_sequence():
    a = ExampleSampler(7, seed=11)
    a.next(5)
    a.next(6)  # into the second epoch
    b = ExampleSampler(7, seed=11)
    b.load_state_dict(a.state_dict())
    assert b.next(20) == a.next(20)


def test_example_sampler_refuses_an_empty_set():
    with pytest.raises(ValueError, match="empty"):
        ExampleSampler(0, seed=0)
