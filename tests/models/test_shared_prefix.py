"""grpolab.models.shared_prefix: the shared-prompt forward gives the plain forward's log-probs, also when
rows of one group (one ``prompt_index``) carry different prompts (C5-3: a verifiers env whose
``setup_state`` varies each rollout's opening)."""

from contextlib import nullcontext

import torch

from grpolab.algorithms.grpo_update import forward_tokens, microbatch_log_probs
from grpolab.core import pad_token_id
from grpolab.rollout.base import Rollout
from grpolab.training.batching import make_rollout_batch


def test_c5_3_rows_of_one_prompt_index_with_different_prompts_match_the_plain_forward(tiny_model):
    model, tok = tiny_model()
    model.eval()
    torch.manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = [tok("Round 0. What is 2+3?")["input_ids"], tok("Round 1, a longer opening. What is 7-4?")["input_ids"],
               tok("Round 0. What is 2+3?")["input_ids"]]
    responses = [torch.randint(3, vocab, (n,)).tolist() for n in (5, 7, 6)]
    # every row is of prompt_index 0 (one group), the second one opening differently
    rollouts = [Rollout("", "", p, r, [0.0] * len(r), "length", 0) for p, r in zip(prompts, responses)]
    batch = make_rollout_batch(rollouts, torch.zeros(3), torch.zeros(3), pad_token_id(tok))
    tensors, rows, figures = batch.tensors(), [0, 1, 2], {}
    for shared in (False, True):
        mb, log_probs, _, to_labels = microbatch_log_probs(model, tensors, batch, rows, shared, "cpu", nullcontext, 1.0)
        figures[shared] = to_labels(log_probs.detach() * mb["response_mask"])
    mask = batch.response_mask
    assert int(mask[1].sum()) == len(responses[1])
    gap = float(((figures[True] - figures[False]) * mask).abs().max())
    # float32 in another summation order; scoring the second row under the first row's prompt: ~1e-2
    assert gap < 1e-5, f"the shared-prompt forward is {gap} nats off the plain forward"
    # the speed figure counts what that forward runs: the two distinct prompts once each
    assert forward_tokens(batch.sequences, rows, True) == len(prompts[0]) + len(prompts[1]) + sum(map(len, responses))
