"""grpolab.models.precision: the fp32 head switch survives pickling (C5-2: the spawned sampler process of
``max_staleness >= 1`` receives the sampling model pickled) as it survives ``copy.deepcopy``."""

import pickle

import torch

from grpolab.models import logits_fp32_enabled, set_logits_fp32


def test_c5_2_the_fp32_head_pickles_with_its_model_and_stays_bound_to_the_copy(tiny_model):
    model, _ = tiny_model()
    set_logits_fp32(model)
    twin = pickle.loads(pickle.dumps(model))
    head = twin.get_output_embeddings()
    assert logits_fp32_enabled(twin) and head.forward.__self__ is head
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(ids).logits, twin(ids).logits
    assert got.dtype == torch.float32 and torch.equal(got, want)
    set_logits_fp32(twin, on=False)
    assert not logits_fp32_enabled(twin) and logits_fp32_enabled(model)
