"""The HF backend in a sampler process of its own (``rollout.process``): it samples what the
in-process backend samples from the same weights and seed, takes new weights only when told to
load them (staging is a second buffer), re-raises the child's errors, and a child that dies is one
line, never a hang. Every test starts a real spawned process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from grpolab.rollout import RolloutBackendError, SamplingParams
from grpolab.rollout.process import ProcessRolloutBackend
from tests.helpers.rounding import float32_logprob_error
from tests.helpers.sampling import one_thread_samples

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["12+30=", "7+5=", "40+41="]
SAMPLING = SamplingParams(max_tokens=8, min_tokens=1, stop=["</answer>"])


@pytest.fixture(scope="module")
def lm():
    from grpolab.models import load_model_and_tokenizer

    return load_model_and_tokenizer("embedded:tiny", seed=0)


@pytest.fixture(scope="module")
def sampler(lm):
    model, tok = lm
    backend = ProcessRolloutBackend(model, tok, threads=1, seed=0)
    yield backend
    backend.close()


def in_process(model, tok, seed: int):
    return one_thread_samples(model, tok, PROMPTS, 3, SAMPLING, seed)


def largest_gap(a, b) -> float:
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs))


def perturbed(model, scale: float, seed: int):
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return out


def test_it_samples_what_the_in_process_backend_samples_and_loads_staged_weights_only_when_told(sampler, lm):
    model, tok = lm
    tol = 4 * float32_logprob_error(model, tok, PROMPTS, max_tokens=8)["max"]
    sampler.reseed(11)
    assert largest_gap(sampler.generate(PROMPTS, 3, SAMPLING), in_process(model, tok, 11)) <= tol

    new = perturbed(model, 0.2, seed=1)
    sampler.stage(new.state_dict().items())  # staged, not loaded: the child still samples the old weights
    sampler.reseed(12)
    assert largest_gap(sampler.generate(PROMPTS, 3, SAMPLING), in_process(model, tok, 12)) <= tol
    sampler.load_staged()
    sampler.reseed(12)
    loaded = sampler.generate(PROMPTS, 3, SAMPLING)
    assert largest_gap(loaded, in_process(new, tok, 12)) <= tol
    old = in_process(model, tok, 12)
    assert [r.response_ids for r in loaded] != [r.response_ids for r in old] or \
        largest_gap(loaded, old) > 100 * tol, "the loaded weights changed nothing"
    sampler.sync_weights(model)  # back to the module's weights for the other tests


def test_a_childs_error_is_raised_as_it_was_and_an_unknown_weight_is_refused(sampler):
    with pytest.raises(ValueError, match="empty prompt"):
        sampler.generate([""], 1, SAMPLING)
    assert sampler.generate(PROMPTS[:1], 1, SAMPLING)  # the child goes on after an error
    with pytest.raises(KeyError, match="not in the sampler's model"):
        sampler.stage([("model.no_such.weight", torch.zeros(1))])


def test_a_sampler_process_that_dies_is_one_line_not_a_hang(lm):
    model, tok = lm
    backend = ProcessRolloutBackend(model, tok, threads=1)
    try:
        backend.process.kill()
        with pytest.raises(RolloutBackendError, match=r"sampler process died during generate \(exit code -9\)") as err:
            backend.generate(PROMPTS, 1, SAMPLING)
        assert "\n" not in str(err.value)
    finally:
        backend.close()
    assert not backend.process.is_alive()


def test_a_script_without_a_main_guard_is_not_run_again_in_the_child(tmp_path):
    """A spawned child would import the caller's ``__main__``: a script with no ``if __name__ ==
    "__main__"`` guard would start its work (and another sampler) again in it."""
    script = tmp_path / "unguarded.py"
    marker = tmp_path / "runs.txt"
    script.write_text(textwrap.dedent(f"""
        from grpolab.models import load_model_and_tokenizer
        from grpolab.rollout import SamplingParams
        from grpolab.rollout.process import ProcessRolloutBackend
        with open({str(marker)!r}, "a") as f:
            f.write("run\\n")
        model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
        backend = ProcessRolloutBackend(model, tok)
        print(len(backend.generate(["1+1="], 2, SamplingParams(max_tokens=4))))
        backend.close()
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                              "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("2")
    assert marker.read_text() == "run\n"


def test_c5_2_a_model_the_child_cannot_unpickle_is_one_line_not_a_blocked_write(tmp_path):
    """C5-2: the spawn payload is written whole before CPython sees the child die, so a model that fails
    to unpickle in the child (an instance-bound fp32 head did) and is larger than a pipe's buffer
    blocked the trainer for good; the weights now go through the pipe, read whole, and fail in one line."""
    script = tmp_path / "unpicklable.py"
    script.write_text(textwrap.dedent("""
        from grpolab.models import load_model_and_tokenizer
        from grpolab.rollout.process import ProcessRolloutBackend, SamplerProcessError

        class OnlyInTheParent:  # __main__ is not imported in the child: it does not unpickle there
            pass

        model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
        model.only_in_the_parent = OnlyInTheParent()
        model.payload = b"x" * (8 << 20)  # unpickled after it: far past a pipe's buffer
        try:
            ProcessRolloutBackend(model, tok)
        except SamplerProcessError as exc:
            print("ERROR", exc)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                              "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "could not start" in lines[0] and "OnlyInTheParent" in lines[0], out.stdout
