"""Evaluation metrics: pass@k, maj@k (ties, equivalent answers), consistency, diversity, perplexity,
and evaluation forwards with dropout off."""

import math

import pytest
import torch

from grpolab.eval import eval_mode
from grpolab.eval.metrics import (
    answer_classes,
    consistency,
    distinct_n,
    maj_at_k,
    majority_vote,
    mean_distinct_answers,
    pass_at_k,
    perplexity,
)
from grpolab.models import load_model_and_tokenizer


def test_pass_at_k_matches_closed_form():
    for n, c, k in [(10, 3, 1), (10, 3, 5), (5, 0, 2), (5, 5, 3), (8, 2, 8)]:
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_majority_consistency_and_diversity_by_hand():
    answers = ["5", "5", "6", None]
    assert consistency(answers) == 0.5
    assert maj_at_k(answers, [True, True, False, False]) == 1.0
    assert maj_at_k(answers, [False, False, True, False]) == 0.0
    assert consistency([None, None]) == 0.0
    assert maj_at_k([None, None], [False, False]) == 0.0
    assert mean_distinct_answers([["5", "5", "6"], ["1", None]]) == 1.5
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 1) == pytest.approx(4 / 6)
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 2) == pytest.approx(3 / 4)
    assert distinct_n([[1]], 2) == 0.0


def test_maj_at_k_scores_a_tie_as_the_expected_value_over_the_tied_answers():
    # two answers tie for the majority, one is right: a random pick among them is right half the time
    assert maj_at_k(["5", "6"], [True, False]) == 0.5
    assert maj_at_k(["6", "5"], [False, True]) == 0.5  # the order the answers were seen in does not matter
    assert maj_at_k(["5", "5", "6", "6", "7"], [True, True, False, False, False]) == 0.5
    assert maj_at_k(["1", "2", "3"], [False, False, True]) == pytest.approx(1 / 3)
    assert maj_at_k(["5", "6", "6"], [True, False, False]) == 0.0  # no tie: the majority is wrong
    assert consistency(["5", "5", "6", "6"]) == 0.5


def test_equivalent_answers_are_one_answer_for_maj_consistency_and_diversity():
    answers = ["0.25", "0.5", "1/2"]  # "0.5" and "1/2" are the same answer: it has the majority
    assert answer_classes(answers) == [0, 1, 1]
    assert maj_at_k(answers, [False, True, True]) == 1.0
    assert consistency(answers) == pytest.approx(2 / 3)
    assert mean_distinct_answers([answers]) == 2
    assert majority_vote(["\\frac{1}{2}", "0.5", "3", None], [True, True, False, False]) == majority_vote(
        ["1/2", "1/2", "3", None], [True, True, False, False])
    # the grouping is a parameter: exact string equality keeps them apart (a three-way tie)
    assert maj_at_k(answers, [False, True, True], equal=lambda a, b: a == b) == pytest.approx(2 / 3)


class _Uniform(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        return type("O", (), {"logits": torch.zeros(*ids.shape, self.vocab)})()


class _Dropout(torch.nn.Module):
    """A little LM whose outputs change from call to call while dropout is on."""

    def __init__(self, vocab=37, p=0.5):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, 16)
        self.drop = torch.nn.Dropout(p)
        self.head = torch.nn.Linear(16, vocab)
        self.frozen = torch.nn.Linear(1, 1).eval()

    def forward(self, ids, **_):
        return type("O", (), {"logits": self.head(self.drop(self.emb(ids)))})()


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    ids = torch.randint(0, 37, (1000,)).tolist()
    assert perplexity(_Uniform(37), ids, max_length=64, stride=16) == pytest.approx(37.0, rel=1e-4)


def test_strided_perplexity_counts_every_token_once():
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    ids = tok("Q: 1+2\nA: <think>1+2=3</think> <answer>3</answer>" * 4, add_special_tokens=False)["input_ids"]
    full = perplexity(model, ids, max_length=len(ids), stride=len(ids))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    direct = math.exp(float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))))
    assert full == pytest.approx(direct, rel=1e-5)
    strided = perplexity(model, ids, max_length=32, stride=8)
    assert strided > 1 and math.isfinite(strided)


def test_perplexity_runs_with_dropout_off_and_restores_training_mode():
    model = _Dropout().train()
    model.frozen.eval()
    ids = torch.randint(0, 37, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    first = perplexity(model, ids, max_length=64, stride=32)
    assert perplexity(model, ids, max_length=64, stride=32) == first
    assert model.training and model.drop.training and not model.frozen.training


def test_eval_mode_restores_each_flag_even_after_an_error():
    model = _Dropout().train()
    model.frozen.eval()
    with pytest.raises(RuntimeError):
        with eval_mode(model):
            assert not model.training and not model.drop.training and not torch.is_grad_enabled()
            raise RuntimeError("boom")
    assert model.training and model.drop.training and not model.frozen.training
