"""grpolab.training.inputs: a config's data fields -> examples, template and reward (every trainer)."""

import json

import pytest

from grpolab.algorithms.dpo import DPOConfig
from grpolab.algorithms.sft import SFTConfig
from grpolab.data import DataError, get_task, load_template
from grpolab.training.inputs import (
    load_inputs,
    load_preference_inputs,
    load_sft_inputs,
    looks_like_sft_pairs,
    task_or_file,
    task_preference_pairs,
)

R1_RIGHT = "2+1=3</think> <answer>3</answer>"


def _jsonl(path, records, extra_lines=()):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def test_load_inputs_from_an_embedded_task():
    cfg = SFTConfig(task="arithmetic", task_train_size=12, eval_examples=5, seed=2)
    inputs = load_inputs(cfg)
    task = get_task("arithmetic", seed=2)
    assert [e.question for e in inputs.train] == [e.question for e in task.examples("train", 12)]
    assert [e.question for e in inputs.evals] == [e.question for e in task.examples("validation", 5)]
    assert not {e.question for e in inputs.train} & {e.question for e in inputs.evals}
    assert inputs.template.text == load_template(task.default_template).text
    assert inputs.reward is task.reward_fn  # the task's own verifier


def test_load_inputs_from_files_with_named_fields(tmp_path):
    train = _jsonl(tmp_path / "q.jsonl", [{"q": f"{i}+1", "a": i + 1} for i in range(6)], ["{broken"])
    held = _jsonl(tmp_path / "held.jsonl", [{"q": f"{i}+2", "a": i + 2} for i in range(9)])
    cfg = SFTConfig(task=None, train_data=train, eval_data=held, data_format="jsonl", question_field="q",
                    answer_field="a", data_on_error="skip", eval_examples=4)
    with pytest.warns(UserWarning, match="skipped 1"):
        inputs = load_inputs(cfg)
    assert [(e.question, e.answer) for e in inputs.train] == [(f"{i}+1", i + 1) for i in range(6)]
    assert [e.question for e in inputs.evals] == [f"{i}+2" for i in range(4)]  # capped at eval_examples
    assert inputs.template.text == load_template("r1_zero").text  # a file defaults to r1_zero ...
    assert inputs.reward(R1_RIGHT, "3")["reward"] == 1.0  # ... and its reward
    assert inputs.reward("3", "3")["reward"] == 0.0
    strict = cfg.model_copy(update={"data_on_error": "raise"})
    with pytest.raises(DataError, match=r"q.jsonl:7: invalid JSON"):
        load_inputs(strict)


def test_load_inputs_without_eval_data_from_a_file_validates_on_nothing(tmp_path):
    train = _jsonl(tmp_path / "q.jsonl", [{"question": "1+1", "answer": "2"}])
    inputs = load_inputs(SFTConfig(task=None, train_data=train, prompt_template="compact", reward="r1_zero_lenient"))
    assert inputs.evals == [] and inputs.template.text == load_template("compact").text


def test_task_or_file(tmp_path):
    examples, template, reward = task_or_file("task:arithmetic", 3, seed=1, split="test")
    assert [e.question for e in examples] == [e.question for e in get_task("arithmetic", seed=1).examples("test", 3)]
    assert template.text == load_template("compact").text and reward(R1_RIGHT, "3")["reward"] == 1.0
    data = _jsonl(tmp_path / "f.jsonl", [{"question": f"{i}", "answer": f"{i}"} for i in range(5)])
    examples, template, _ = task_or_file(data, 2)
    assert [e.question for e in examples] == ["0", "1"] and template.text == load_template("r1_zero").text


def test_looks_like_sft_pairs(tmp_path):
    assert looks_like_sft_pairs(_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r"}]))
    assert not looks_like_sft_pairs(_jsonl(tmp_path / "b.jsonl", [{"question": "q", "answer": "a"}]))
    assert not looks_like_sft_pairs(_jsonl(tmp_path / "c.jsonl", [], ["not json"]))
    assert not looks_like_sft_pairs(_jsonl(tmp_path / "d.jsonl", [], ["[1, 2]"]))
    assert not looks_like_sft_pairs(_jsonl(tmp_path / "e.jsonl", []))
    assert looks_like_sft_pairs(_jsonl(tmp_path / "f.jsonl", [], ["", json.dumps({"prompt": "p", "response": "r"})]))


def test_load_sft_inputs_from_task_solutions():
    cfg = SFTConfig(task="arithmetic", task_train_size=5)
    pairs, inputs = load_sft_inputs(cfg)
    assert [p.prompt for p in pairs] == [inputs.template.format(e.question) for e in inputs.train]
    assert [p.response for p in pairs] == [e.solution for e in inputs.train]
    assert [p.ground_truth for p in pairs] == [e.answer for e in inputs.train]


def test_load_sft_inputs_from_cs336_pairs(tmp_path):
    data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"P{i}", "response": f"R{i}", "ground_truth": str(i)}
                                           for i in range(3)])
    pairs, inputs = load_sft_inputs(SFTConfig(task=None, train_data=data))
    assert [(p.prompt, p.response, p.ground_truth) for p in pairs] == [(f"P{i}", f"R{i}", str(i)) for i in range(3)]
    assert inputs.train == pairs and inputs.evals == []


def test_load_sft_inputs_refuses_examples_without_a_solution(tmp_path):
    data = _jsonl(tmp_path / "q.jsonl", [{"question": "1+1", "answer": "2"}])
    with pytest.raises(DataError, match="example 0 has no worked solution"):
        load_sft_inputs(SFTConfig(task=None, train_data=data))


def test_task_preference_pairs_prefer_the_correct_solution():
    template = load_template("compact")
    pairs = task_preference_pairs("arithmetic", "train", 6, seed=0, options={"wrong_fraction": 0.5}, template=template)
    examples = get_task("arithmetic", seed=0, wrong_fraction=0.0).examples("train", 6)
    reward = get_task("arithmetic").reward_fn
    for pair, example in zip(pairs, examples):
        assert pair.prompt == template.format(example.question)
        assert pair.chosen == example.solution  # wrong_fraction is ignored: chosen is always right
        assert reward(pair.chosen, example.answer)["reward"] == 1.0
        assert reward(pair.rejected, example.answer)["reward"] == 0.0
        assert (
            pair.rejected.rpartition("<answer>")[0] == pair.chosen.rpartition("<answer>")[0]
        )  # only the answer differs
    assert task_preference_pairs("arithmetic", "train", 6, 0, {}, template) == pairs  # seeded


def test_load_preference_inputs_holds_out_a_seeded_tenth(tmp_path):
    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}", "chosen": "c", "rejected": "r"} for i in range(30)])
    cfg = DPOConfig(task=None, train_data=data, seed=1)
    train, held = load_preference_inputs(cfg)
    assert len(held) == 3 and len(train) == 27
    assert sorted(p.prompt for p in train + held) == sorted(f"p{i}" for i in range(30))
    assert load_preference_inputs(cfg) == (train, held)
    other, _ = load_preference_inputs(cfg.model_copy(update={"seed": 2}))
    assert [p.prompt for p in other] != [p.prompt for p in train]
    held_file = _jsonl(tmp_path / "h.jsonl", [{"prompt": f"h{i}", "chosen": "c", "rejected": "r"} for i in range(5)])
    train, held = load_preference_inputs(cfg.model_copy(update={"eval_data": held_file, "eval_pairs": 4}))
    assert len(train) == 30 and [p.prompt for p in held] == ["h0", "h1", "h2", "h3"]


def test_load_preference_inputs_from_a_task():
    train, held = load_preference_inputs(DPOConfig(task_train_size=4, eval_pairs=3))
    assert len(train) == 4 and len(held) == 3
    assert not {p.prompt for p in train} & {p.prompt for p in held}
