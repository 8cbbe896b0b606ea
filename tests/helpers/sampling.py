"""What the in-process HF backend samples, on one torch thread (a sampler process's thread count:
the same arithmetic), for comparing a backend that samples elsewhere against it."""

from __future__ import annotations

import torch


def one_thread_samples(model, tokenizer, prompts: list[str], n: int, sampling, seed: int):
    from grpolab.rollout import HFRolloutBackend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = HFRolloutBackend(model, tokenizer, generator=torch.Generator().manual_seed(seed))
        return backend.generate(prompts, n, sampling)
    finally:
        torch.set_num_threads(threads)
