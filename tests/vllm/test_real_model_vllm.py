"""The vLLM backend on the one real pretrained model, SmolLM2-135M-Instruct (GQA, tied embeddings,
a 49k BPE vocabulary, ChatML): greedy chat responses equal the Hugging Face backend's. This venv
only reads the directory ``scripts/real_model.py`` converted (``make test-vllm`` gets it first with
``.venv``'s python); where it could not be had, the test is skipped with the one-line reason."""

import pytest
import torch

from grpolab.models import load_model_and_tokenizer
from grpolab.rollout import HFRolloutBackend, SamplingParams
from tests.real import real_model

MODEL_DIR, REASON = real_model.status()
pytestmark = pytest.mark.skipif(MODEL_DIR is None, reason=f"real model unavailable: {REASON}")

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "Give me one tip for staying healthy."]
LOGPROB_TOL = 1e-4  # fp32 on both sides, a 30-layer model


@pytest.fixture(scope="module")
def lm():
    model, tok = load_model_and_tokenizer(str(MODEL_DIR), dtype="float32")
    return model.eval(), tok


def test_greedy_chat_responses_equal_the_hf_backend(lm, engine):
    model, tok = lm
    engine.sync_weights(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in QUESTIONS]
    sampling = SamplingParams(temperature=0.0, max_tokens=24)
    ours, ref = engine.generate(prompts, 1, sampling), HFRolloutBackend(model, tok).generate(prompts, 1, sampling)
    assert [r.prompt_ids for r in ours] == [r.prompt_ids for r in ref]
    assert [(r.response_ids, r.finish_reason, r.response) for r in ours] == \
        [(r.response_ids, r.finish_reason, r.response) for r in ref]
    assert "Paris" in ours[0].response and ours[0].finish_reason == "eos"
    for a, b in zip(ours, ref):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_TOL, rtol=0)
