"""Teaching a tiny model a behaviour in seconds: SFT steps on a fixed batch (the tool tests' fixtures)."""

import torch

from grpolab.core import sft_microbatch_train_step
from grpolab.models.fused_head import response_log_probs


def teach(model, batch: dict, mask: torch.Tensor, steps: int, lr: float = 3e-3):
    """``steps`` AdamW steps of SFT on ``batch`` (``build_sequences``' layout) where ``mask`` is True;
    one torch thread (a few short rows: as fast, and far faster on a busy machine). Returns the model in eval mode."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            lp = response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]
            sft_microbatch_train_step(lp, mask, 1)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return model.eval()
