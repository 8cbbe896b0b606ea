"""grpolab.training.optimization: AdamW, the warm-up/decay schedule, the guarded optimizer step."""

import math

import pytest
import torch

from grpolab.training.optimization import (
    StepResult,
    current_lr,
    effective_warmup,
    make_optimizer,
    make_scheduler,
    optimizer_step,
)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))


def _backward(model, scale=1.0):
    x = torch.arange(6, dtype=torch.float32).view(2, 3)
    loss = scale * model(x).pow(2).mean()
    loss.backward()
    return float(loss.detach())


def _lrs(scheduler, optimizer, n):
    out = []
    for _ in range(n):
        out.append(current_lr(optimizer))
        optimizer.step()
        scheduler.step()
    return out


# ---------------------------------------------------------------- optimizer and schedule
def test_make_optimizer_is_adamw_over_trainable_parameters_only():
    model = _model()
    model[0].requires_grad_(False)
    opt = make_optimizer(model, 0.1, betas=(0.8, 0.9), weight_decay=0.01)
    assert isinstance(opt, torch.optim.AdamW)
    params = opt.param_groups[0]["params"]
    assert len(params) == 2 and all(p is q for p, q in zip(params, model[1].parameters()))
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["weight_decay"] == 0.01
    assert current_lr(opt) == 0.1


def test_make_optimizer_fuses_plain_cpu_parameters_into_the_same_adamw_update():
    """One fused kernel on plain CPU tensors; its weights after 20 steps are AdamW's to float32
    rounding (bound: 2 ulp of the largest weight per step)."""
    torch.manual_seed(0)
    fused_model, plain_model = _model(), _model()
    plain_model.load_state_dict(fused_model.state_dict())
    fused = make_optimizer(fused_model, 1e-2, weight_decay=0.01)
    assert fused.defaults["fused"] is True
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(20):
        grads = [torch.randn_like(p) for p in fused_model.parameters()]
        for model, opt in ((fused_model, fused), (plain_model, plain)):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            opt.step()
    for p, q in zip(fused_model.parameters(), plain_model.parameters()):
        bound = 20 * 2 * torch.finfo(torch.float32).eps * float(q.detach().abs().max())
        assert float((p - q).detach().abs().max()) <= bound


@pytest.mark.parametrize("warmup,total,expected", [(1000, 200, 20), (5, 200, 5), (0, 200, 0), (10, 5, 0), (3, 30, 3)])
def test_effective_warmup_is_capped_at_ten_percent_of_the_run(warmup, total, expected):
    assert effective_warmup(warmup, total) == expected


def test_linear_warmup_then_constant():
    opt = make_optimizer(_model(), 1.0)
    sched = make_scheduler(opt, warmup_steps=4, total_steps=20, kind="constant")
    assert _lrs(sched, opt, 7) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])


def test_cosine_decay_endpoints_and_midpoint():
    opt = make_optimizer(_model(), 2.0)
    sched = make_scheduler(opt, warmup_steps=2, total_steps=12, kind="cosine", min_lr_ratio=0.1)
    lrs = _lrs(sched, opt, 14)
    assert lrs[:2] == pytest.approx([1.0, 2.0])  # warm-up: (step + 1) / warmup
    assert lrs[2] == pytest.approx(2.0)  # decay starts at the peak
    assert lrs[7] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # half-way: the mean of peak and floor
    assert lrs[12] == pytest.approx(0.2) and lrs[13] == pytest.approx(0.2)  # the floor, and it stays there
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # monotone after warm-up


def test_constant_schedule_without_warmup_and_unknown_kind():
    opt = make_optimizer(_model(), 0.3)
    assert _lrs(make_scheduler(opt, 0, 10), opt, 5) == pytest.approx([0.3] * 5)
    with pytest.raises(ValueError, match="unknown lr_schedule 'linear'"):
        make_scheduler(opt, 0, 10, kind="linear")


# ---------------------------------------------------------------- the guarded step
def _warm_state(model, opt, sched):
    """One real step, so AdamW has moments and the schedule has moved."""
    _backward(model)
    assert not optimizer_step(model, opt, sched, 1.0).skipped


def _adam_state(opt):
    return {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for p, s in opt.state.items()}


@pytest.mark.parametrize("poison", ["nan_grad", "inf_grad", "inf_loss", "nan_loss"])
def test_a_nonfinite_step_is_skipped_and_moves_nothing(poison):
    model = _model()
    opt = make_optimizer(model, 0.1)
    sched = make_scheduler(opt, warmup_steps=3, total_steps=30)
    _warm_state(model, opt, sched)
    before, state, epoch, lr = ({k: v.clone() for k, v in model.state_dict().items()}, _adam_state(opt),
                                sched.last_epoch, current_lr(opt))
    loss = _backward(model)
    if poison == "nan_grad":
        model[0].weight.grad[0, 0] = float("nan")
    elif poison == "inf_grad":
        model[1].bias.grad[0] = float("inf")
    result = optimizer_step(model, opt, sched, 1.0, loss=float(poison[:3]) if poison.endswith("loss") else loss)
    assert isinstance(result, StepResult) and result.skipped
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    after = _adam_state(opt)
    assert after.keys() == state.keys()
    for p in state:
        for k in state[p]:
            assert torch.equal(torch.as_tensor(after[p][k]), torch.as_tensor(state[p][k])), k
    assert sched.last_epoch == epoch and current_lr(opt) == lr
    assert all(p.grad is None for p in model.parameters())  # the poisoned gradient is dropped


def test_a_finite_step_moves_weights_and_the_schedule():
    model = _model()
    opt = make_optimizer(model, 0.1)
    sched = make_scheduler(opt, warmup_steps=3, total_steps=30)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = _backward(model)
    result = optimizer_step(model, opt, sched, None, loss=loss)
    assert not result.skipped and math.isfinite(result.grad_norm) and result.grad_norm > 0
    assert all(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert sched.last_epoch == 1 and current_lr(opt) == pytest.approx(0.1 * 2 / 3)


def test_grad_norm_is_measured_before_clipping():
    model = _model()
    opt = make_optimizer(model, 0.1)
    _backward(model, scale=100.0)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    assert expected > 1.0
    assert optimizer_step(model, opt, None, 1.0).grad_norm == pytest.approx(expected, rel=1e-5)
    _backward(model, scale=100.0)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    assert optimizer_step(model, opt, None, None).grad_norm == pytest.approx(expected, rel=1e-5)


def test_parameters_without_a_gradient_step_as_if_their_gradient_were_zero():
    model = _model()
    reference = _model()
    opt = make_optimizer(model, 0.1, weight_decay=0.1)
    ref_opt = make_optimizer(reference, 0.1, weight_decay=0.1)
    _backward(model)
    _backward(reference)
    model[0].weight.grad = None  # no row reached this parameter
    reference[0].weight.grad = torch.zeros_like(reference[0].weight)
    optimizer_step(model, opt, None, 1.0)
    optimizer_step(reference, ref_opt, None, 1.0)
    assert model[0].weight in opt.state  # AdamW's moments exist for it (its step count moves too)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
