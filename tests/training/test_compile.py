"""The compiled update (``compile``, ``models.compiled``): the decoder layers under torch.compile give the
eager log-probs and gradients within float32 rounding, one graph serves every length, and the field turns it
on in a run's forward context or refuses in one line. One compile for the module (~40 s on a busy 2-core CPU)."""

import collections
import copy
import json
import math

import pytest
import torch

from grpolab.models.compiled import CompiledLayers, cpu_build_refusal, decoder_layers, graphs_compiled
from grpolab.models.fused_head import response_log_probs
from grpolab.models.tiny import build_tiny_model
from grpolab.training.config import ConfigError
from grpolab.training.run_model import compiled_layers


@pytest.fixture(autouse=True)
def _inductor_builds_here():
    why = cpu_build_refusal(torch.nn.Linear(1, 1))  # the CPU's capability: any CPU module asks the same
    if why is not None:
        pytest.skip(f"compile: {why}")


@pytest.fixture(scope="module")
def compiled_model():
    torch.manual_seed(0)
    model = build_tiny_model("tiny").train()
    return model, CompiledLayers(model)


def batch(rows: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 100, (rows, length + 1), generator=g)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for r in range(rows):  # right-padded responses of different lengths after a 4-token prompt
        mask[r, 3: length - r] = True
    return ids[:, :-1], ids[:, 1:], mask


def log_probs_and_grads(model, ids, labels, mask, context=None):
    model.zero_grad(set_to_none=True)
    with context() if context is not None else torch.enable_grad():
        lp = response_log_probs(model, ids, labels, positions=mask)["log_probs"]
    (lp * mask).sum().backward()
    return lp.detach().double(), torch.cat([p.grad.flatten().double() for p in model.parameters()])


def test_compiled_log_probs_and_gradients_match_eager_within_float32_rounding(compiled_model):
    model, compiled = compiled_model
    ids, labels, mask = batch(3, 21, seed=1)
    before = graphs_compiled()
    lp_c, g_c = log_probs_and_grads(model, ids, labels, mask, compiled)
    assert graphs_compiled() > before  # the compiled layers ran (not the eager ones)
    lp_e, g_e = log_probs_and_grads(model, ids, labels, mask)
    lp_64, g_64 = log_probs_and_grads(copy.deepcopy(model).double(), ids, labels, mask)
    # the bound: eager float32's own distance from float64 (its rounding), with room for a different
    # summation order in the fused kernels; a wrong graph (a dropped residual, a stale mask) is O(1) off
    lp_bound = 10 * float((lp_e - lp_64).abs().max()) + 1e-6
    g_bound = 10 * float((g_e - g_64).norm() / g_64.norm()) + 1e-6
    assert float((lp_c - lp_64).abs().max()) <= lp_bound
    assert float((g_c - g_64).norm() / g_64.norm()) <= g_bound
    assert float((lp_c - lp_e)[mask].abs().max()) > 0 or torch.equal(g_c, g_e)  # compared, not the same call


def test_new_lengths_and_row_counts_reuse_the_graph(compiled_model):
    model, compiled = compiled_model
    log_probs_and_grads(model, *batch(3, 21, seed=1), compiled)  # compiled (once for the module)
    after_first = graphs_compiled()
    for rows, length in ((2, 9), (4, 37), (3, 64), (2, 15), (5, 30)):
        log_probs_and_grads(model, *batch(rows, length, seed=length), compiled)
    assert graphs_compiled() == after_first  # dynamic shapes: no recompile per length
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))  # eager again outside


def test_compile_field_turns_it_on_or_refuses_in_one_line(grpo_config):
    model = build_tiny_model("tiny")
    cpu = torch.device("cpu")
    assert isinstance(compiled_layers(grpo_config(compile=True), model, cpu), CompiledLayers)
    assert compiled_layers(grpo_config(compile=False), model, cpu) is None
    assert compiled_layers(grpo_config(), model, cpu) is None  # auto: not on the CPU (docs/results/compile.md)
    cuda = torch.device("cuda")  # nothing runs on it here: auto's decision only (torch.compile is lazy)
    assert compiled_layers(grpo_config(), build_tiny_model("tiny"), cuda) is None  # GRPO shares prompts by default
    assert isinstance(compiled_layers(grpo_config(share_prompt_prefix=False), build_tiny_model("tiny"), cuda),
                      CompiledLayers)
    with pytest.raises(ConfigError, match="compile: true, but gradient_checkpointing is on"):
        compiled_layers(grpo_config(compile=True, gradient_checkpointing=True), model, cpu)


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_a_grpo_run_with_compile_true_runs_every_trainer_forward_compiled(grpo_config):
    """Through train_grpo: the policy's update (with gradients), its old log-probs (off-policy: two epochs) and
    the reference's (kl_coef > 0) all run the compiled layers, and the run trains (finite loss, weights moved)."""
    from grpolab.algorithms.grpo import train_grpo
    from grpolab.models import compiled

    before = collections.Counter(compiled.calls)
    cfg = grpo_config(compile=True, n_grpo_steps=1, kl_coef=0.1, epochs_per_rollout_batch=2, rollout_batch_size=8,
                      train_batch_size=8, gradient_accumulation_steps=1, eval_examples=2)
    result = train_grpo(cfg)
    ran = compiled.calls - before
    layers = len(decoder_layers(build_tiny_model("tiny")))
    for kind in (("grad", "trained"), ("no_grad", "trained"), ("no_grad", "frozen")):
        assert ran[kind] >= layers, (kind, dict(ran))  # every layer of each forward, not an eager fallback
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)  # two optimizer steps (two epochs)
