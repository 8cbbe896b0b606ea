"""grpolab.training.checkpoints: atomic directories, keep_last, the readable-checkpoint fallback, leftovers."""

import os

import pytest
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.training.checkpoints import (
    STATE_FILE,
    CheckpointManager,
    atomic_directory,
    atomic_write_text,
    check_model_files,
    remove_leftovers,
    save_final,
)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from grpolab.models import load_model_and_tokenizer

    return load_model_and_tokenizer("embedded:tiny", seed=0)


def _truncate(path, keep=0.5):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def _manager_with(tmp_path, model_and_tokenizer, steps, keep_last=5):
    model, tok = model_and_tokenizer
    ckpts = CheckpointManager(tmp_path / "checkpoints", keep_last=keep_last)
    for step in steps:
        ckpts.save(step, model, tok, {"step": step, "tensor": torch.arange(3)})
    return ckpts


def test_save_writes_model_tokenizer_and_state(tmp_path, model_and_tokenizer):
    ckpts = _manager_with(tmp_path, model_and_tokenizer, [4])
    path = tmp_path / "checkpoints" / "step_4"
    assert ckpts.latest() == path
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    state = CheckpointManager.load_state(path)
    assert state["step"] == 4 and torch.equal(state["tensor"], torch.arange(3))
    assert [p.name for p in path.parent.iterdir()] == ["step_4"]  # no temporary directory left behind


def test_keep_last_keeps_only_the_newest(tmp_path, model_and_tokenizer):
    ckpts = _manager_with(tmp_path, model_and_tokenizer, [1, 2, 3, 10], keep_last=2)
    assert [p.name for p in ckpts.all()] == ["step_3", "step_10"]  # numeric order, not lexical
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_10", "step_3"]


def test_all_ignores_incomplete_and_foreign_directories(tmp_path, model_and_tokenizer):
    ckpts = _manager_with(tmp_path, model_and_tokenizer, [1])
    (tmp_path / "checkpoints" / "step_7").mkdir()  # no state file: an incomplete write
    (tmp_path / "checkpoints" / "step_x").mkdir()
    (tmp_path / "checkpoints" / "step_x" / STATE_FILE).write_bytes(b"")
    assert [p.name for p in ckpts.all()] == ["step_1"]
    assert CheckpointManager(tmp_path / "nothing").latest() is None


def test_latest_loadable_skips_a_truncated_state_file(tmp_path, model_and_tokenizer, capsys):
    ckpts = _manager_with(tmp_path, model_and_tokenizer, [1, 2, 3])
    _truncate(tmp_path / "checkpoints" / "step_3" / STATE_FILE)
    path, state = ckpts.latest_loadable()
    assert path.name == "step_2" and state["step"] == 2
    err = capsys.readouterr().err
    assert "step_3" in err and "cannot be read" in err and "step_2" not in err


def test_latest_loadable_skips_truncated_weights(tmp_path, model_and_tokenizer, capsys):
    ckpts = _manager_with(tmp_path, model_and_tokenizer, [1, 2, 3])
    _truncate(tmp_path / "checkpoints" / "step_3" / "model.safetensors")
    _truncate(tmp_path / "checkpoints" / "step_2" / "model.safetensors", keep=0.99)
    path, state = ckpts.latest_loadable()
    assert path.name == "step_1" and state["step"] == 1
    err = capsys.readouterr().err
    assert "step_3" in err and "step_2" in err and "step_1" not in err
    assert err.count("cannot be read") == 2


def test_latest_loadable_is_none_when_nothing_reads(tmp_path, model_and_tokenizer, capsys):
    ckpts = _manager_with(tmp_path, model_and_tokenizer, [1])
    (tmp_path / "checkpoints" / "step_1" / "model.safetensors").unlink()
    assert ckpts.latest_loadable() is None
    assert "no model weights" in capsys.readouterr().err


def test_check_model_files(tmp_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    with pytest.raises(FileNotFoundError, match="no model weights"):
        check_model_files(tmp_path)
    save_final(model, tok, tmp_path / "final")
    check_model_files(tmp_path / "final")
    _truncate(tmp_path / "final" / "model.safetensors")
    with pytest.raises(SafetensorError, match="incomplete metadata"):
        check_model_files(tmp_path / "final")


def test_remove_leftovers_removes_tmp_and_old_directories_only(tmp_path):
    for name in (".tmp_step_4_abc", ".old_step_2", ".tmp_final_x", "step_5", ".hidden"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    (tmp_path / ".tmp_file").write_text("a file, not a directory")
    removed = remove_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == [".old_step_2", ".tmp_final_x", ".tmp_step_4_abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", ".tmp_file", "step_5"]
    assert remove_leftovers(tmp_path / "missing") == []


def test_atomic_directory_replaces_the_target_whole(tmp_path):
    target = tmp_path / "final"
    atomic_directory(target, lambda d: (d / "a.txt").write_text("old"))
    atomic_directory(target, lambda d: (d / "b.txt").write_text("new"))
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]  # replaced, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no .tmp_ / .old_ left


def test_a_failed_atomic_write_leaves_the_old_directory_and_no_leftovers(tmp_path):
    target = tmp_path / "final"
    atomic_directory(target, lambda d: (d / "a.txt").write_text("old"))

    def fail(d):
        (d / "partial.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_directory(target, fail)
    assert (target / "a.txt").read_text() == "old" and not (target / "partial.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_atomic_write_text(tmp_path):
    path = tmp_path / "config.yaml"
    atomic_write_text(path, "a: 1\n")
    atomic_write_text(path, "a: 2\n")
    assert path.read_text() == "a: 2\n"
    assert os.listdir(tmp_path) == ["config.yaml"]


def test_save_final_is_a_hugging_face_directory_with_extra_files(tmp_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    out = save_final(model, tok, tmp_path / "final", extra=lambda d: (d / "value_head.safetensors").write_bytes(b"x"))
    assert (out / "value_head.safetensors").read_bytes() == b"x"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert AutoTokenizer.from_pretrained(out)("1+2")["input_ids"] == tok("1+2")["input_ids"]


def test_pruning_keeps_the_newest_readable_checkpoints(tmp_path, model_and_tokenizer):
    # step_4 is unreadable, the run resumed from step_2 and now checkpoints every 3 steps
    # (checkpoint_every may change on resume)
    model, tok = model_and_tokenizer
    ckpts = _manager_with(tmp_path, model_and_tokenizer, [2, 4], keep_last=2)
    _truncate(tmp_path / "checkpoints" / "step_4" / "model.safetensors")
    path, _ = ckpts.latest_loadable()  # what --resume does: step_4 is skipped and moved aside
    assert path.name == "step_2" and (tmp_path / "checkpoints" / "unreadable_step_4").is_dir()
    ckpts.save(3, model, tok, {"step": 3})
    ckpts.save(6, model, tok, {"step": 6})
    names = [p.name for p in ckpts.all()]
    assert "step_3" in names and "step_6" in names, names  # the two newest a resume could use


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    ckpts = _manager_with(tmp_path, model_and_tokenizer, [4], keep_last=1)
    ckpts.save(3, model, tok, {"step": 3})  # an older step than one on disk (checkpoint_every changed)
    assert (tmp_path / "checkpoints" / "step_3" / "trainer_state.pt").exists()
