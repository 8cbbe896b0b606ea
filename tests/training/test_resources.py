"""Resources bounded up front (training/resources.py): prompts fit the context, the rollout's KV
cache fits memory, a group larger than the batch bound is sampled in parts."""

import json
import sys

import pytest
import torch

from grpolab.algorithms.grpo import GRPOConfig, train_grpo
from grpolab.data import DataError, load_examples, load_template
from grpolab.models import load_model_and_tokenizer
from grpolab.rollout import HFRolloutBackend, SamplingParams
from grpolab.training.resources import check_prompt_lengths, check_rollout_memory, rollout_memory_bytes


@pytest.fixture
def long_file(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"question": "1+1", "answer": "2"}, {"question": "9" * 600, "answer": "9"},
            {"question": "2+2", "answer": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_prompt_longer_than_the_context_is_refused_with_its_file_and_line(long_file, tmp_path):
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)  # context 512
    examples = list(load_examples(str(long_file)))
    with pytest.raises(DataError, match=rf"{long_file}:2: the prompt is \d+ tokens; with sampling_max_tokens 16 it "
                                        r"exceeds the model's context of 512 tokens"):
        check_prompt_lengths(examples, load_template("compact"), tok, model, 16)
    # through a trainer: refused before the run directory exists
    cfg = GRPOConfig(task=None, train_data=str(long_file), prompt_template="compact", reward="arithmetic",
                     rollout_batch_size=4, group_size=2, train_batch_size=4, gradient_accumulation_steps=1,
                     sampling_max_tokens=16, run_dir=str(tmp_path / "run"), show_progress=False, device="cpu")
    with pytest.raises(DataError, match=f"{long_file}:2"):
        train_grpo(cfg)
    assert not (tmp_path / "run").exists()


def test_with_skip_the_long_prompt_is_dropped_and_reported(long_file, capsys):
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    examples = list(load_examples(str(long_file)))
    kept = check_prompt_lengths(examples, load_template("compact"), tok, model, 16, on_error="skip")
    assert [e.question for e in kept] == ["1+1", "2+2"]
    assert (
        f"skipped 1 example(s) whose prompt does not fit the context; first: {long_file}:2" in capsys.readouterr().err
    )


def test_rollout_memory_estimate_and_refusal(monkeypatch):
    model, _ = load_model_and_tokenizer("embedded:tiny", seed=0)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4 * 8 * 100  # fp32, 8 rows x 100 tokens
    assert rollout_memory_bytes(model, 8, 100) == kv + 4 * 8 * c.vocab_size
    monkeypatch.setenv("GRPOLAB_MEMORY_BYTES", str(kv // 2))
    with pytest.raises(DataError, match="lower rollout_max_batch_size or sampling_max_tokens"):
        check_rollout_memory(model, torch.device("cpu"), 8, 50, 50)
    monkeypatch.setenv("GRPOLAB_MEMORY_BYTES", str(10 * kv))
    check_rollout_memory(model, torch.device("cpu"), 8, 50, 50)  # fits: no error


def test_a_group_larger_than_the_batch_bound_is_sampled_in_parts():
    model, tok = load_model_and_tokenizer("embedded:tiny", seed=0)
    backend = HFRolloutBackend(model, tok, max_batch_size=4, generator=torch.Generator().manual_seed(0))
    seen = []
    original = backend._generate_chunk

    def spy(prompts, prompt_ids, chunk, n, sampling, generator):
        seen.append(len(chunk) * n)
        return original(prompts, prompt_ids, chunk, n, sampling, generator)

    backend._generate_chunk = spy
    rollouts = backend.generate(["Q: 1+1\nA: <think>", "Q: 2+2\nA: <think>"], 10, SamplingParams(max_tokens=4))
    assert max(seen) <= 4 and sum(seen) == 20
    assert [r.prompt_index for r in rollouts] == [0] * 10 + [1] * 10


# ---------------------------------------------------------------- CPU threads


def test_cpu_threads_probe_keeps_the_faster_count_and_says_so(monkeypatch):
    from grpolab.training.resources import choose_cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # one busy core: every core is slower than one (the spinning-thread collapse)
        chosen, line = choose_cpu_threads(None, measure=lambda t: {1: 0.031, 2: 0.072}[t])
        assert chosen == 1 and torch.get_num_threads() == 1
        assert line == ("torch threads: 1 (probe: 1 thread 31.0 ms, 2 threads 72.0 ms; set threads in the config or "
                        "OMP_NUM_THREADS to choose)")
        torch.set_num_threads(2)
        assert choose_cpu_threads(None, measure=lambda t: {1: 0.04, 2: 0.025}[t])[0] == 2  # a quiet machine
        assert torch.get_num_threads() == 2
        # the real probe runs, picks one of the two, and leaves the global random stream as it was
        torch.manual_seed(5)
        expected = torch.rand(3)
        torch.manual_seed(5)
        assert choose_cpu_threads(None)[0] in (1, 2)
        assert torch.equal(torch.rand(3), expected)
    finally:
        torch.set_num_threads(before)


def test_cpu_threads_given_or_set_in_the_environment_are_not_probed(monkeypatch):
    from grpolab.training.resources import choose_cpu_threads

    def never(threads):
        raise AssertionError("probed")

    before = torch.get_num_threads()
    try:
        assert choose_cpu_threads(1, measure=never) == (1, None) and torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        assert choose_cpu_threads(None, probe=False, measure=never) == (2, None)  # deterministic / torchrun
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(2)
        assert choose_cpu_threads(None, measure=never) == (2, None)
    finally:
        torch.set_num_threads(before)


def test_a_run_takes_the_configured_thread_count(tmp_path):
    before = torch.get_num_threads()
    try:
        cfg = GRPOConfig(model="embedded:tiny", task="arithmetic", run_dir=str(tmp_path / "run"), n_grpo_steps=1,
                         rollout_batch_size=4, group_size=2, train_batch_size=4, gradient_accumulation_steps=2,
                         sampling_max_tokens=8, eval_examples=2, show_progress=False, device="cpu", threads=1)
        torch.set_num_threads(2)
        train_grpo(cfg)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# what a fresh block costs in page faults, in a process of its own (glibc's malloc settings are process-wide)
_FAULTS = """
import resource, sys, torch
from grpolab.training.resources import keep_freed_memory
if sys.argv[1] == "run":  # a tiny GRPO run sets the process up as any run does
    from grpolab.algorithms.grpo import GRPOConfig, train_grpo
    train_grpo(GRPOConfig(model="embedded:tiny", n_grpo_steps=1, rollout_batch_size=4, group_size=2,
                          train_batch_size=4, gradient_accumulation_steps=1, sampling_max_tokens=4,
                          eval_every=0, device="cpu", threads=1, show_progress=False, run_dir=sys.argv[3],
                          keep_freed_memory=sys.argv[2] == "1"), overwrite=True)
elif sys.argv[2] == "1":
    assert keep_freed_memory() == (sys.argv[1] == "direct")
n = 48 * 2**20 // 4  # 48 MB: over glibc's largest mmap threshold (32 MB)
faults = []
for _ in range(10):  # allocated, touched, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(n).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults))  # kept, measured: 12k for the first, then 12k or 0 for 1-2 more while glibc settles, then 0
"""


def _refault_count(how: str, keep: bool, run_dir, **env) -> int:
    import os
    import subprocess

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"},
           "OMP_NUM_THREADS": "1", **env}
    out = subprocess.run([sys.executable, "-c", _FAULTS, how, "1" if keep else "0", str(run_dir)], check=True,
                         capture_output=True, text=True, timeout=300, env=env)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def glibc_faults(tmp_path_factory):
    """Page faults of ten 48 MB re-allocations with glibc's defaults and with ``keep_freed_memory()``
    called directly: the references both tests below compare with (each count a process of its own)."""
    import ctypes

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt: Linux only")
    try:
        ctypes.CDLL("libc.so.6").mallopt  # noqa: B018
    except (OSError, AttributeError):
        pytest.skip("not glibc: keep_freed_memory leaves this allocator as it is")
    tmp = tmp_path_factory.mktemp("faults")
    return {"default": _refault_count("direct", False, tmp / "default"),
            "kept": _refault_count("direct", True, tmp / "kept")}


@pytest.mark.parametrize("how", ["direct", "run"])
def test_a_freed_big_block_is_reused_without_page_faults_once_memory_is_kept(how, glibc_faults, tmp_path):
    default = glibc_faults["default"]
    kept = glibc_faults["kept"] if how == "direct" else _refault_count("run", True, tmp_path / "kept")
    # glibc's default: each 48 MB block is fresh pages again (12,288 at 4 KiB; fewer on huge pages); kept: most reuse
    assert default > 0
    assert kept <= default // 2, (kept, default)


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_a_malloc_setting_in_the_environment_wins_over_keep_freed_memory(glibc_faults, tmp_path):
    """``grpolab plan``'s check sets ``MALLOC_MMAP_THRESHOLD_`` so that RSS measures live memory: a run
    given it (or ``GLIBC_TUNABLES``) leaves glibc as the environment set it, every big block fresh pages."""
    kept = glibc_faults["kept"]
    # keep_freed_memory() itself (it returns False), and a run asked to keep under the plan's setting
    for how, env in [("env", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}),
                     ("run", {"MALLOC_MMAP_THRESHOLD_": "131072"})]:
        told = _refault_count(how, True, tmp_path / f"told{how}", **env)
        assert told > 2 * max(kept, 1000), (env, how, told, kept)  # every block faults afresh: ~12k each
