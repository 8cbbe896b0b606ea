"""``models.fused_head.response_log_probs`` equals ``core.get_response_log_probs`` (the plain CS336
reference) on the embedded tiny model: log-probs, entropies and the head's gradients, over several chunks."""

import pytest
import torch

from tests.helpers.fused_head_check import assert_same, fused_and_plain


@pytest.mark.parametrize("temperature,chunk_tokens", [(1.0, 5), (0.7, 3), (1.3, None)])
def test_the_fused_head_gives_the_plain_log_probs_and_gradients(tiny_model, monkeypatch, temperature, chunk_tokens):
    model, _ = tiny_model(seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=g)
    labels = torch.randint(0, model.config.vocab_size, (3, 9), generator=g)
    assert_same(fused_and_plain(model, ids, labels, temperature, chunk_tokens, monkeypatch))
