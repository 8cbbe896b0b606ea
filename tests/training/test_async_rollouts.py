"""``AsyncRollouts`` on a real sampler process: batch ``b`` is sampled under exactly the weights
the trainer had after step ``b - k`` (checked against the in-process backend on a copy of those
weights), never the newer ones being trained, and a producer error reaches the trainer."""

from __future__ import annotations

import copy

import pytest
import torch

from grpolab.rollout import SamplingParams
from grpolab.rollout.process import ProcessRolloutBackend
from grpolab.training.async_rollouts import AsyncRollouts
from grpolab.training.batching import ExampleSampler
from tests.helpers.rounding import float32_logprob_error
from tests.helpers.sampling import one_thread_samples

PROMPTS = ["12+30=", "7+5="]
SAMPLING = SamplingParams(max_tokens=6, min_tokens=1)
STEPS = 6


def sampled_by(model, tok, seed: int):
    return one_thread_samples(model, tok, PROMPTS, 2, SAMPLING, seed)


def gap(a, b) -> float:
    if [r.response_ids for r in a] != [r.response_ids for r in b]:
        return float("inf")
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs))


@pytest.mark.parametrize("k", [1, 2])
def test_each_batch_is_sampled_under_the_weights_of_step_b_minus_k(k):
    from grpolab.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    tol = 4 * float32_logprob_error(model, tok, PROMPTS, max_tokens=6)["max"]
    versions = {0: copy.deepcopy(model)}
    backend = ProcessRolloutBackend(model, tok, threads=1)
    data = ExampleSampler(10, 0)
    rollouts = AsyncRollouts(backend, k, lambda b: backend.generate(PROMPTS, 2, SAMPLING), data,
                             lambda x: x, lambda x: x, lambda b: backend.reseed(1000 + b))
    g = torch.Generator().manual_seed(0)
    try:
        rollouts.start(0, STEPS)
        for step in range(STEPS):
            produced = rollouts.get(step)
            assert produced.version == max(0, step - k)
            assert gap(produced.item, sampled_by(versions[produced.version], tok, 1000 + step)) <= tol
            if produced.version != step:  # the weights the trainer holds now sample otherwise
                assert gap(produced.item, sampled_by(versions[step], tok, 1000 + step)) > tol
            with torch.no_grad():  # "train": a large step, so every version samples differently
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
            versions[step + 1] = copy.deepcopy(model)
            rollouts.publish(step + 1, model.state_dict().items())
    finally:
        rollouts.close()
        backend.close()
        rollouts.join()


def test_a_producer_error_is_raised_in_the_trainer():
    class Failing:
        def load_staged(self):
            pass

    def produce(b):
        if b == 1:
            raise ValueError("reward exploded")
        return b

    rollouts = AsyncRollouts(Failing(), 1, produce, ExampleSampler(4, 0), lambda x: x, lambda x: x, lambda b: None)
    rollouts.start(0, 4)
    assert rollouts.get(0).item == 0
    with pytest.raises(ValueError, match="reward exploded"):
        rollouts.get(1)
    rollouts.close()
    rollouts.join()
