"""hf:NAME[:CONFIG][@SPLIT] with the real ``datasets`` package on a local dataset folder; evaluation data
defaults to the test (else validation) split, never the training questions (issue 59)."""

import json

import pytest

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.data import DataError, load_examples
from grpolab.training.inputs import load_inputs

pytest.importorskip("datasets", reason="the datasets extra is not installed")


def _folder(root, splits):
    root.mkdir()
    for split in splits:
        rows = [{"question": f"{split} question {i}", "answer": str(i)} for i in range(3)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_evaluation_data_reads_the_test_split_and_training_data_the_train_split(tmp_path):
    folder = _folder(tmp_path / "ds", ["train", "test"])
    cfg = GRPOConfig(train_data=f"hf:{folder}", eval_data=f"hf:{folder}", model="embedded:tiny")
    inputs = load_inputs(cfg)
    assert [e.question for e in inputs.train] == [f"train question {i}" for i in range(3)]
    assert [e.question for e in inputs.evals] == [f"test question {i}" for i in range(3)]
    assert [e.question for e in load_examples(f"hf:{folder}@train", split=None)][0] == "train question 0"


def test_validation_when_there_is_no_test_split_and_a_named_split_else(tmp_path):
    folder = _folder(tmp_path / "ds", ["train", "validation"])
    assert load_examples(f"hf:{folder}", split=None)[0].question == "validation question 0"
    only = _folder(tmp_path / "only", ["train"])
    with pytest.raises(DataError, match=r"has no test or validation split \(it has train\): name the evaluation "
                                        r"split, e.g. hf:.*only@train"):
        load_examples(f"hf:{only}", split=None)
    with pytest.raises(DataError, match=r"expected hf:NAME\[:CONFIG\]\[@SPLIT\]"):
        load_examples(f"hf:{only}@")


def test_training_data_without_evaluation_data_is_said(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n')
    inputs = load_inputs(GRPOConfig(train_data=str(path), model="embedded:tiny"))
    assert inputs.evals == []
    assert f"train_data {path} comes without eval_data: no validation" in capsys.readouterr().err
