"""grpolab.algorithms.expert_iteration: SFT on the exact sampled ids of the verified responses
(end token included), and the trainer's filter-then-train loop."""

import pytest
import torch

import grpolab.algorithms.expert_iteration as ei
from grpolab.algorithms.expert_iteration import EIConfig, sft_on_kept, train_expert_iteration
from grpolab.training.metric_logging import read_metrics
from tests.helpers.reward_fixtures import reward_any_digit
from tests.helpers.sft_reference import hand_sft_gradient


def test_sft_on_kept_trains_the_exact_ids_including_the_end_token(tiny_model, open_run, tmp_path, small_run):
    model, tok = tiny_model()
    eos = tok.eos_token_id
    kept = [([5, 6, 7], [8, 9, eos]), ([5, 10], [11, 12, 13, eos])]
    cfg = EIConfig(train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=None, run_dir=str(tmp_path / "ei"),
                   **small_run)
    run = open_run(cfg, model, tok)
    before = [p.detach().clone() for p in run.model.parameters()]
    loss, expected = hand_sft_gradient(run.model, kept, 1.0)
    nll = loss * len(kept)  # the summed NLL of every response id
    _, without_eos = hand_sft_gradient(run.model, [(p, r[:-1]) for p, r in kept], 1.0)
    optimizer = torch.optim.SGD(run.model.parameters(), lr=1.0)  # one step: weights - gradient
    losses = sft_on_kept(run, optimizer, kept, cfg, step=0, pad_id=tok.pad_token_id)
    assert len(losses) == 1 and run.train_step == 1
    applied = [b - p.detach() for b, p in zip(before, run.model.parameters())]
    for got, want in zip(applied, expected):
        assert torch.allclose(got, want, atol=1e-6)
    # the end token is part of what is learned: without it the gradient is another one
    assert not all(torch.allclose(got, other, atol=1e-6) for got, other in zip(applied, without_eos))
    assert losses[0] == pytest.approx(nll / (3 + 4), rel=1e-5)  # the logged figure: NLL per response token


def test_sft_on_kept_takes_sft_epochs_passes(tiny_model, open_run, tmp_path, small_run):
    model, tok = tiny_model()
    kept = [([5, 6], [7 + i, tok.eos_token_id]) for i in range(6)]
    cfg = EIConfig(train_batch_size=4, gradient_accumulation_steps=2, sft_epochs=2, run_dir=str(tmp_path / "ei"),
                   **small_run)
    run = open_run(cfg, model, tok)
    losses = sft_on_kept(run, torch.optim.SGD(run.model.parameters(), lr=0.0), kept, cfg, 0, tok.pad_token_id)
    assert len(losses) == 2 * 6 // 4  # sft_epochs x kept / train_batch_size optimizer steps
    assert [r["ei_step"] for r in read_metrics(run.metrics_path)] == [0] * 3


def test_expert_iteration_filters_and_trains(tmp_path, monkeypatch, tiny_model, weights, small_run):
    """Seeded and deterministic: each step keeps exactly the responses the verifier accepts, trains
    on exactly their sampled ids (end token included), and the weights move."""
    sampled, trained = [], []
    make_backend, accumulate = ei.run_backend, ei.accumulate_sft_gradient

    def recording_backend(*args, **kw):
        backend = make_backend(*args, **kw)
        generate = backend.generate

        def record(prompts, n, sampling):
            out = generate(prompts, n, sampling)
            sampled.append(out)
            return out

        backend.generate = record
        return backend

    def recording_accumulate(model, sequences, *args, **kw):
        trained.append([(list(p), list(r)) for p, r in sequences])
        return accumulate(model, sequences, *args, **kw)

    monkeypatch.setattr(ei, "run_backend", recording_backend)
    monkeypatch.setattr(ei, "accumulate_sft_gradient", recording_accumulate)
    cfg = EIConfig(n_ei_steps=2, ei_batch_size=8, group_size=4, train_batch_size=4, gradient_accumulation_steps=2,
                   learning_rate=1e-3, run_dir=str(tmp_path / "ei"),
                   reward="tests.helpers.reward_fixtures:reward_any_digit", **small_run)
    model, tok = tiny_model()
    before = weights(model)
    result = train_expert_iteration(cfg, model=model, tokenizer=tok)

    steps = [s for s in sampled if len(s) == cfg.ei_batch_size * cfg.group_size]  # the rest is validation
    assert len(steps) == 2
    kept = [[r for r in s if reward_any_digit(r.response, None)["reward"] >= 1.0] for s in steps]
    assert result.filtered_sizes == [len(k) for k in kept]
    assert all(0 < len(k) < 32 for k in kept)  # the filter kept some and dropped some
    records = [r for r in read_metrics(result.metrics_path) if "ei/filtered_size" in r]
    assert [r["ei/filtered_size"] for r in records] == result.filtered_sizes
    assert all("ei/response_entropy" in r and "ei/sft_token_nll" in r for r in records)
    # training happened in every step, on the exact ids of the kept responses
    updates = [r for r in read_metrics(result.metrics_path) if "train/token_nll" in r]
    assert sorted({r["ei_step"] for r in updates}) == [0, 1]
    n_batches = [sum(1 for r in updates if r["ei_step"] == s) for s in (0, 1)]
    assert len(trained) == sum(n_batches)
    for step, batches in zip((0, 1), (trained[: n_batches[0]], trained[n_batches[0]:])):
        exact = {(tuple(r.prompt_ids), tuple(r.response_ids)) for r in kept[step]}
        assert all((tuple(p), tuple(r)) in exact for batch in batches for p, r in batch)
    ended = [r for k in kept for r in k if r.finish_reason == "eos"]
    assert ended, "no kept response ended with the end token in this seeded run"
    assert all(r.response_ids[-1] == tok.eos_token_id for r in ended)
    trained_ids = {(tuple(p), tuple(r)) for batch in trained for p, r in batch}
    assert any(r[-1] == tok.eos_token_id for _, r in trained_ids)  # an end token was trained on
    after = result.final_dir / "model.safetensors"
    from safetensors.torch import load_file

    final = load_file(after)
    assert any(not torch.equal(final[k], before[k]) for k in final)
