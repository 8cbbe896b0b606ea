"""grpolab.algorithms.dpo: the CS336 per-instance loss, the batched gradient, held-out preference
accuracy, and the trainer."""

import json
import math

import pytest
import torch

from grpolab.algorithms.dpo import (
    ALPACA_TEMPLATE,
    DPOConfig,
    compute_per_instance_dpo_loss,
    dpo_gradient,
    preference_accuracy,
    train_dpo,
)
from grpolab.core import compute_dpo_loss, get_response_log_probs, tokenize_prompt_and_output
from grpolab.data import PreferencePair
from grpolab.training.metric_logging import read_metrics

CPU = torch.device("cpu")
PAIRS = [PreferencePair(f"Q: {i}+1", f"{i + 1}", f"{i + 2} no") for i in range(4)]


def logp_sum(model, tok, prompt, response):
    """log pi(response + eos | prompt), written out."""
    b = tokenize_prompt_and_output([prompt], [response + tok.eos_token], tok)
    lp = get_response_log_probs(model, b["input_ids"], b["labels"])["log_probs"]
    return (lp * b["response_mask"]).sum()


def test_per_instance_dpo_loss_matches_its_definition(tiny_model):
    lm, tok = tiny_model(0)
    ref, _ = tiny_model(1)
    loss = compute_per_instance_dpo_loss(lm, ref, tok, 0.5, "Q: 2+2", "4", "5")
    prompt = ALPACA_TEMPLATE.format(instruction="Q: 2+2")
    with torch.no_grad():
        margin = 0.5 * ((logp_sum(lm, tok, prompt, "4") - logp_sum(ref, tok, prompt, "4"))
                        - (logp_sum(lm, tok, prompt, "5") - logp_sum(ref, tok, prompt, "5")))
    assert loss.item() == pytest.approx(-torch.nn.functional.logsigmoid(margin).item(), rel=1e-5)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.parameters())
    assert all(p.grad is None for p in ref.parameters())


def test_dpo_gradient_is_the_mean_pair_loss_gradient_for_any_accumulation(tiny_model):
    lm, tok = tiny_model(0)
    ref, _ = tiny_model(1)
    grads, totals, counts = [], [], []
    for accumulation in (1, 2, 4):
        cfg = DPOConfig(beta=0.3, train_batch_size=4, gradient_accumulation_steps=accumulation)
        lm.zero_grad(set_to_none=True)
        total, correct = dpo_gradient(lm, ref, tok, PAIRS, cfg, CPU)
        grads.append([p.grad.clone() for p in lm.parameters()])
        totals.append(total)
        counts.append(correct)
    lm.zero_grad(set_to_none=True)
    losses, margins = [], []
    for p in PAIRS:
        c, r = logp_sum(lm, tok, p.prompt, p.chosen), logp_sum(lm, tok, p.prompt, p.rejected)
        with torch.no_grad():
            rc, rr = logp_sum(ref, tok, p.prompt, p.chosen), logp_sum(ref, tok, p.prompt, p.rejected)
        losses.append(compute_dpo_loss(c, r, rc, rr, 0.3))
        margins.append(float(((c - rc) - (r - rr)).detach()))
    expected_loss = torch.stack(losses).mean()
    expected_loss.backward()
    for total, g in zip(totals, grads):
        assert total == pytest.approx(expected_loss.item(), rel=1e-5)
        assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(g, lm.parameters()))
    assert counts == [sum(m > 0 for m in margins)] * 3  # pairs whose implicit reward margin is positive


def test_preference_accuracy_by_hand(tiny_model):
    lm, tok = tiny_model(0)
    ref, _ = tiny_model(1)
    same = preference_accuracy(lm, lm, tok, PAIRS, 0.5, False, CPU)
    assert same == {"preference_accuracy": 0.0, "dpo_loss": pytest.approx(math.log(2)), "reward_margin": 0.0}
    with torch.no_grad():
        margins = [0.5 * ((logp_sum(lm, tok, p.prompt, p.chosen) - logp_sum(ref, tok, p.prompt, p.chosen))
                          - (logp_sum(lm, tok, p.prompt, p.rejected) - logp_sum(ref, tok, p.prompt, p.rejected)))
                   for p in PAIRS]
    margins = torch.stack(margins)
    for batch_size in (1, 3, 32):
        out = preference_accuracy(lm, ref, tok, PAIRS, 0.5, False, CPU, batch_size=batch_size)
        assert out["preference_accuracy"] == (margins > 0).float().mean().item()
        assert out["reward_margin"] == pytest.approx(margins.mean().item(), rel=1e-4, abs=1e-6)
        assert out["dpo_loss"] == pytest.approx(-torch.nn.functional.logsigmoid(margins).mean().item(), rel=1e-4)
    with pytest.raises(ValueError, match="no held-out preference pairs"):
        preference_accuracy(lm, ref, tok, [], 0.5, False, CPU)


def test_dpo_preference_accuracy_rises_on_separable_pairs(tmp_path):
    # separable: the chosen response always says "yes", the rejected one "no"
    data = tmp_path / "toy.jsonl"
    with open(data, "w") as f:
        for i in range(200):
            f.write(json.dumps({"prompt": f"Q: {i}?", "chosen": f"yes {i}", "rejected": f"no {i}"}) + "\n")
    cfg = DPOConfig(task=None, train_data=str(data), n_dpo_steps=30, learning_rate=1e-3, beta=0.5, train_batch_size=16,
                    run_dir=str(tmp_path / "dpo"), show_progress=False, device="cpu")
    result = train_dpo(cfg)
    assert result.before["preference_accuracy"] == 0.0  # policy == reference: no margin yet
    assert result.after["preference_accuracy"] >= 0.9
    rows = [r for r in read_metrics(result.metrics_path) if "train/dpo_loss" in r]
    assert len(rows) == 30 and rows[-1]["train/dpo_loss"] < rows[0]["train/dpo_loss"]


def test_dpo_on_task_pairs_moves_the_margin(tmp_path):
    result = train_dpo(
        DPOConfig(n_dpo_steps=5, train_batch_size=4, task_train_size=20, eval_pairs=8, learning_rate=1e-3,
                  run_dir=str(tmp_path / "t"), show_progress=False, device="cpu")
    )
    assert result.before["preference_accuracy"] == 0.0 and result.before["reward_margin"] == 0.0
    assert result.after["reward_margin"] != 0.0
    rows = [r for r in read_metrics(result.metrics_path) if "train/dpo_loss" in r]
    assert len(rows) == 5 and rows[0]["train/dpo_loss"] == pytest.approx(math.log(2), rel=1e-4)


def test_dpo_on_a_preference_file(tmp_path):
    data = tmp_path / "pref.jsonl"
    with open(data, "w") as f:
        for i in range(30):
            f.write(json.dumps({"prompt": f"say {i}", "chosen": f"{i}", "rejected": f"{i + 1}"}) + "\n")
    result = train_dpo(
        DPOConfig(task=None, train_data=str(data), n_dpo_steps=2, train_batch_size=4, use_alpaca_template=True,
                  run_dir=str(tmp_path / "d"), show_progress=False, device="cpu")
    )
    assert result.before["preference_accuracy"] == 0.0  # 3 held-out pairs (a seeded tenth), no margin before training
    assert result.after["preference_accuracy"] in (0.0, 1 / 3, 2 / 3, 1.0) and result.after["reward_margin"] != 0.0
    evals = [r for r in read_metrics(result.metrics_path) if "eval_step" in r]
    assert [r["dpo_step"] for r in evals] == [0, 2]


def test_a_nan_loss_never_reaches_the_weights_and_is_counted(tmp_path, capsys):
    """One embedding row is NaN, so every batch's loss is NaN: each optimizer step is skipped,
    counted in health/nonfinite_steps and reported; the other weights do not move."""
    from grpolab.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.convert_tokens_to_ids("<think>")] = float("nan")  # in every prompt
    start = {k: v.clone() for k, v in model.state_dict().items()}
    result = train_dpo(DPOConfig(n_dpo_steps=3, train_batch_size=4, task_train_size=8, eval_pairs=4, learning_rate=1e-3,
                                 run_dir=str(tmp_path / "dpo"), show_progress=False, device="cpu"),
                       model=model, tokenizer=tok)
    steps = [r for r in read_metrics(result.metrics_path) if "train_step" in r]
    assert [r["health/nonfinite_steps"] for r in steps] == [1, 2, 3]
    for name, value in model.state_dict().items():
        assert torch.equal(torch.nan_to_num(value), torch.nan_to_num(start[name])), name
    captured = capsys.readouterr()
    assert "skipped: the loss or gradient norm is not finite" in captured.out + captured.err
