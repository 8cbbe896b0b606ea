"""Multi-turn tool use through the vLLM backend (a real engine): the same rollouts as through the
HF backend, observations appended as exact ids, and the sampler's log-probs of the model's tokens
equal to the trainer's with the observations in context."""

import pytest
import torch

from grpolab.core import build_sequences
from grpolab.envs import EnvBackend, build_env, loss_mask_tensor
from grpolab.models import load_model_and_tokenizer
from grpolab.models.fused_head import response_log_probs
from grpolab.rollout import HFRolloutBackend, SamplingParams
from tests.helpers.tool_models import ENV, tool_prompts

LOGPROB_TOL = 1e-5  # fp32 on both sides


@pytest.fixture(scope="module")
def lm(tool_model_dir):
    model, tok = load_model_and_tokenizer(str(tool_model_dir))
    return model.eval(), tok


def test_greedy_multi_turn_rollouts_equal_the_hf_backends(lm, engine):
    model, tok = lm
    engine.sync_weights(model)
    env = build_env(**ENV)
    sampling = SamplingParams(temperature=0.0, max_tokens=40, stop=["</answer>"])
    ours = EnvBackend(engine, env).generate(tool_prompts(), 1, sampling)
    ref = EnvBackend(HFRolloutBackend(model, tok), env).generate(tool_prompts(), 1, sampling)
    assert sum(r.info["tool_calls"] > 0 and r.info["observation_tokens"] > 0 for r in ours) >= len(ours) // 2
    assert [(r.response_ids, r.loss_mask, r.response, r.finish_reason, r.info) for r in ours] == \
        [(r.response_ids, r.loss_mask, r.response, r.finish_reason, r.info) for r in ref]
    for a, b in zip(ours, ref):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_TOL, rtol=0)


def test_sampled_multi_turn_log_probs_are_the_trainers_with_observations_in_context(lm, engine):
    model, tok = lm
    engine.sync_weights(model)
    engine.generator = torch.Generator().manual_seed(3)
    out = EnvBackend(engine, build_env(**ENV)).generate(
        tool_prompts(), 4, SamplingParams(temperature=1.0, max_tokens=40, stop=["</answer>"])
    )
    assert sum(r.info["observation_tokens"] > 0 for r in out) >= len(out) // 4  # observations in the context
    batch = build_sequences([r.prompt_ids for r in out], [r.response_ids for r in out], tok.pad_token_id)
    mask = batch["response_mask"] & loss_mask_tensor([len(r.prompt_ids) for r in out], [r.loss_mask for r in out],
                                                     batch["labels"].shape)
    with torch.no_grad():
        trainer = response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]
    for i, r in enumerate(out):
        start = len(r.prompt_ids) - 1
        sampled = torch.tensor(r.logprobs)
        model_tokens = torch.tensor(r.loss_mask)
        assert torch.equal(mask[i, start : start + len(r.response_ids)], model_tokens)
        assert torch.all(sampled[~model_tokens] == 0.0)  # observations: context, not samples
        assert torch.allclose(sampled[model_tokens], trainer[i, start : start + len(r.response_ids)][model_tokens],
                              atol=LOGPROB_TOL, rtol=0)
