"""Run directories written before the redesign (tests/fixtures/runs_bc5f7ed: grpolab at bc5f7ed,
when the shared machinery lived in grpolab/algorithms/) still resume with today's grpolab, and
nothing a checkpoint pickles names a grpolab module, so moving a module cannot break a resume."""

import os
import pickletools
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "runs_bc5f7ed"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def pickled_globals(path: Path) -> set[str]:
    """The ``module.name`` of every global a torch checkpoint's pickle refers to."""
    found = set()
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if not name.endswith(".pkl"):
                continue
            strings: list[str] = []
            for op, arg, _ in pickletools.genops(archive.read(name)):
                if op.name == "GLOBAL":
                    found.add(arg.replace(" ", "."))
                elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
                    strings.append(arg)
                elif op.name == "STACK_GLOBAL":
                    found.add(".".join(strings[-2:]))
    return found


@pytest.mark.parametrize("method,run,steps_flag", [("grpo", "grpo_run", "--n-grpo-steps"),
                                                   ("sft", "sft_run", "--n-sft-steps")])
def test_an_old_run_directory_resumes(tmp_path, method, run, steps_flag):
    shutil.copytree(FIXTURES, tmp_path, dirs_exist_ok=True)
    step_2 = load_file(str(tmp_path / run / "checkpoints" / "step_2" / "model.safetensors"))
    old_state = pickled_globals(tmp_path / run / "checkpoints" / "step_2" / "trainer_state.pt")
    # two more steps: a resume that extends a cosine schedule (sft) takes its first step at the lr the
    # old schedule ended with (0), then the new schedule's
    out = subprocess.run([sys.executable, "-m", "grpolab", method, "--resume", run, steps_flag, "4",
                          "--show-progress", "false"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from {run}/checkpoints/step_2" in out.stderr, out.stderr[-2000:]
    final = load_file(str(tmp_path / run / "final" / "model.safetensors"))
    assert final.keys() == step_2.keys()
    assert any(not (final[k] == step_2[k]).all() for k in final), "the resumed steps did not train"
    new_state = pickled_globals(tmp_path / run / "checkpoints" / "step_4" / "trainer_state.pt")
    # nothing a checkpoint pickles names a grpolab module (so moving one cannot break a resume)
    for state, names in (("old", old_state), ("new", new_state)):
        assert names, f"the {state} trainer state: no globals found: the scan read nothing"
        assert not [n for n in names if n.startswith("grpolab")], (state, sorted(names))


def test_the_scan_sees_a_pickled_grpolab_object(tmp_path):
    import torch

    from grpolab.training.run import ListState

    torch.save({"samples": ListState([1]), "t": torch.zeros(2)}, tmp_path / "state.pt")
    assert "grpolab.training.run.ListState" in pickled_globals(tmp_path / "state.pt")
