"""Same seed, same machine, same numbers — however busy the machine is (in the serial scale tier: its CPU
hogs would slow the light tier's parallel workers): the same short GRPO run
(the demo's task, two torch threads, its own reward workers) twice, once beside CPU hogs that keep
every core busy, ends in bit-identical weights. Anything that depends on timing (a reward timeout,
worker scheduling, a thread count chosen at run time) would make the two differ."""

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

# a reward that varies within groups (the random tiny model scores 0 on arithmetic: nothing would train),
# scored by supervised worker processes, off-policy (two epochs), with a validation in between
RUN = ["--config", "configs/grpo_tiny.yaml", "--n-grpo-steps", "2", "--rollout-batch-size", "16", "--group-size", "4",
       "--train-batch-size", "8", "--gradient-accumulation-steps", "2", "--epochs-per-rollout-batch", "2",
       "--eval-examples", "4", "--eval-every", "1", "--sampling-max-tokens", "12", "--show-progress", "false",
       "--reward", "tests.helpers.reward_fixtures:length_parity", "--reward-workers", "2", "--learning-rate", "0.003"]
HOG = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n    pass\n"


def _train(run_dir) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-m", "grpolab", "grpo", *RUN, "--run-dir", str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(run_dir / "final" / "model.safetensors"))


def test_a_run_beside_cpu_hogs_ends_in_the_same_weights(tmp_path):
    quiet = _train(tmp_path / "quiet")
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(3)]  # more runnable threads than cores
    try:
        busy = _train(tmp_path / "busy")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert quiet.keys() == busy.keys()
    different = [k for k in quiet if not torch.equal(quiet[k], busy[k])]
    assert not different, different
    from grpolab.models import load_model_and_tokenizer

    base = load_model_and_tokenizer("embedded:tiny", seed=0)[0].state_dict()
    assert any(not torch.equal(quiet[k], base[k]) for k in quiet if k in base)  # the run did train
