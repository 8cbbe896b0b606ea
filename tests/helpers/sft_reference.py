"""The SFT loss written out by hand, the reference the SFT and expert-iteration gradients are tested against."""

import torch


def hand_sft_gradient(model, sequences, normalize_constant):
    """The SFT loss written out: mean over sequences of (sum of the response tokens' NLL) / constant;
    a sequence's optional third item is a per-response-token mask (False: not trained on)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for prompt, response, *mask in sequences:
        ids = torch.tensor(prompt + response)
        logp = torch.log_softmax(model(ids[None, :-1]).logits[0].float(), -1)
        positions = torch.arange(len(prompt) - 1, len(ids) - 1)
        if mask and mask[0] is not None:
            positions = positions[torch.tensor(mask[0])]
        total = total - logp[positions, ids[positions + 1]].sum()
    loss = total / normalize_constant / len(sequences)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)  # leave no gradient behind for the code under test
    return loss.item(), grads
