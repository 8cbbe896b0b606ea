"""Where each loaded record came from, and one-line errors for files that hold no records."""

import json
import sys
import types

import pytest

from grpolab.data import (
    DataError,
    get_task,
    load_examples,
    load_gsm8k,
    load_hf_dataset,
    load_jsonl,
    load_math,
    load_preferences,
    load_sft_pairs,
)

GOOD = {
    "jsonl": {"question": "1+1", "answer": "2"},
    "gsm8k": {"question": "Q", "answer": "1 + 1 = 2\n#### 2"},
    "math": {"problem": "P", "solution": "so \\boxed{2}"},
    "sft": {"prompt": "p", "response": "r"},
    "pref": {"prompt": "p", "chosen": "a", "rejected": "b"},
}
LOADERS = {"jsonl": load_jsonl, "gsm8k": load_gsm8k, "math": load_math, "sft": load_sft_pairs, "pref": load_preferences}


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def source_of(record):
    return record.meta["source"] if hasattr(record, "meta") else record.source


# ---------------------------------------------------------------- where a record came from
@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_each_record_names_its_file_and_line(tmp_path, kind):
    f = write(tmp_path / f"{kind}.jsonl", "\n".join([json.dumps(GOOD[kind]), "", json.dumps(GOOD[kind])]) + "\n")
    records = LOADERS[kind](f)
    assert [source_of(r) for r in records] == [f"{f}:1", f"{f}:3"]


def test_load_examples_keeps_the_source_and_skipped_lines_keep_their_numbers(tmp_path):
    f = write(tmp_path / "gsm8k_train.jsonl", "not json\n" + json.dumps(GOOD["gsm8k"]) + "\n")
    with pytest.warns(UserWarning, match="skipped 1"):
        ex = load_examples(str(f), on_error="skip")
    assert ex[0].meta == {"source": f"{f}:2"} and ex.skipped[0].startswith(f"{f}:1:")


def test_task_examples_name_task_split_and_index():
    ex = get_task("arithmetic", seed=0).examples("validation", 4)
    assert [e.meta["source"] for e in ex] == [f"task:arithmetic:validation:{i}" for i in range(4)]
    # an index names the same question whatever the number asked for
    assert get_task("arithmetic", seed=0).examples("validation", 2)[1].question == ex[1].question


def test_records_built_in_code_have_no_source():
    from grpolab.data import PreferencePair, SFTPair

    assert SFTPair("p", "r").source is None and SFTPair("p", "r", "1").ground_truth == "1"
    assert PreferencePair("p", "a", "b").source is None


def test_hf_examples_name_dataset_split_and_row(monkeypatch):
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split: [{"question": "Q", "answer": "x\n#### 3"}]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    ex = load_hf_dataset("some/gsm8k", split="test", answer_format="gsm8k")
    assert (ex[0].answer, ex[0].meta["source"]) == ("3", "some/gsm8k[test]:0")


# ---------------------------------------------------------------- files with nothing to load
@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_directory_is_one_clear_error(tmp_path, kind):
    with pytest.raises(DataError) as err:
        LOADERS[kind](tmp_path)
    assert str(err.value) == f"{tmp_path}: is a directory, not a data file"


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_an_empty_file_is_one_clear_error(tmp_path, kind):
    f = write(tmp_path / "empty.jsonl", "")
    with pytest.raises(DataError) as err:
        LOADERS[kind](f)
    assert str(err.value) == f"{f}: no examples (the file is empty)"
    g = write(tmp_path / "blank.jsonl", "\n  \n")
    with pytest.raises(DataError, match="no examples .the file has only blank lines"):
        LOADERS[kind](g)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_every_line_skipped_is_one_clear_error(tmp_path, kind):
    f = write(tmp_path / "bad.jsonl", "\n{oops\n[1]\n\"x\"\n")
    with pytest.raises(DataError) as err:
        LOADERS[kind](f, on_error="skip")
    message = str(err.value)
    assert message.startswith(f"{f}: no examples (all 3 lines were skipped: first problem at line 2: invalid JSON")
    assert "\n" not in message


def test_load_examples_checks_directories_and_empty_files(tmp_path):
    for fmt in ("auto", "gsm8k", "math", "jsonl"):
        with pytest.raises(DataError, match="is a directory"):
            load_examples(str(tmp_path), format=fmt)
    f = write(tmp_path / "math_empty.jsonl", "")
    with pytest.raises(DataError, match="no examples"):
        load_examples(str(f))
    with pytest.raises(DataError, match="no such file"):
        load_examples(str(tmp_path / "missing.jsonl"))


def test_require_field_is_public():
    from grpolab.data import require_field

    assert require_field({"a": 1}, "a") == 1
    with pytest.raises(KeyError, match="empty field 'a'"):
        require_field({"a": " "}, "a")
