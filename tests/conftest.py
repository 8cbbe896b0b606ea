import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup`` (make test): a module with a test that uses a module-scoped
    fixture (a server, a background run, a batch of refused commands started together) is one xdist group,
    all its tests on one worker in a row, so the fixture is made once, not once on each worker (or again
    after another module's test ran in between); every other test is placed on its own. Without xdist
    the marker does nothing."""
    if not config.pluginmanager.hasplugin("xdist"):  # e.g. .venv-vf04's pytest: no such marker to set
        return
    shared = set()
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
            shared.add(item.nodeid.split("::")[0])
    for item in items:
        module = item.nodeid.split("::")[0]
        if module in shared:
            item.add_marker(pytest.mark.xdist_group(module))


@pytest.fixture(scope="session")
def char_tokenizer():
    from grpolab.models.tiny import build_char_tokenizer

    return build_char_tokenizer()


# ---------------------------------------------------------------- shared by the trainer tests
# Small settings every sampled-run test can start from (tiny batches, short responses, CPU).
SMALL_RUN = dict(sampling_max_tokens=12, sampling_min_tokens=1, eval_examples=4, show_progress=False, device="cpu",
                 task_train_size=40)


@pytest.fixture
def small_run():
    """The small sampled-run settings (a fresh dict per test)."""
    return dict(SMALL_RUN)


@pytest.fixture
def tiny_model():
    """``tiny_model(seed=0)`` -> (model, tokenizer): the embedded tiny Llama, float32, on CPU."""
    from grpolab.models import load_model_and_tokenizer

    return lambda seed=0: load_model_and_tokenizer("embedded:tiny", seed=seed)


@pytest.fixture
def weights():
    """``weights(module)`` -> a detached copy of its state dict (to compare before/after)."""
    return lambda module: {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture
def same_weights():
    """``same_weights(a, b)``: two state dicts (or modules) hold bit-identical tensors."""

    def same(a, b) -> bool:
        a = a.state_dict() if isinstance(a, torch.nn.Module) else a
        b = b.state_dict() if isinstance(b, torch.nn.Module) else b
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    return same


@pytest.fixture
def grpo_config(tmp_path):
    """``grpo_config(**overrides)`` -> a GRPOConfig for a 3-step run of 16 rollouts (4 x 4) in ``tmp_path/run``."""
    from grpolab.algorithms.grpo import GRPOConfig

    def make(**kw):
        base = dict(n_grpo_steps=3, rollout_batch_size=16, group_size=4, train_batch_size=16,
                    gradient_accumulation_steps=2, sampling_max_tokens=6, sampling_min_tokens=1, learning_rate=1e-3,
                    warmup_steps=0, eval_examples=4, log_generations_samples=2, run_dir=str(tmp_path / "run"),
                    show_progress=False, task_train_size=50, device="cpu")
        base.update(kw)
        return GRPOConfig(**base)

    return make


@pytest.fixture
def open_run(tmp_path):
    """``open_run(cfg, model, tokenizer)`` -> a ``Run`` in ``cfg.run_dir`` (closed at teardown), for calling a
    trainer's phases (policy_update, ppo_update, sft_on_kept) directly."""
    from grpolab.training.run import Run

    runs = []

    def make(cfg, model=None, tokenizer=None):
        run = Run(cfg, model=model, tokenizer=tokenizer)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()
