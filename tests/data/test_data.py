"""Datasets, prompt templates and embedded tasks."""

import json

import pytest

from grpolab.data import (
    DataError,
    get_task,
    gsm8k_final_answer,
    load_examples,
    load_gsm8k,
    load_hf_dataset,
    load_jsonl,
    load_math,
    load_preferences,
    load_sft_pairs,
    load_template,
    split_of,
)
from grpolab.data.prompts import R1_ZERO_PROMPT, TemplateError


def write(path, lines):
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return path


# ---------------------------------------------------------------- JSONL
def test_load_jsonl_custom_fields_and_blank_lines(tmp_path):
    f = write(
        tmp_path / "d.jsonl", [json.dumps({"q": "1+1", "a": 2}), "", json.dumps({"q": "2+2", "a": ["4", "four"]})]
    )
    ex = load_jsonl(f, question_field="q", answer_field="a")
    assert [(e.question, e.answer) for e in ex] == [("1+1", 2), ("2+2", ["4", "four"])]
    assert ex.skipped == []


@pytest.mark.parametrize(
    "bad,problem",
    [
        ('{"question": "x", "answer": ', "invalid JSON"),
        ('{"question": "x"}', "missing field 'answer'"),
        ('{"question": "  ", "answer": "1"}', "empty field 'question'"),
        (b'{"question": "\xff", "answer": "1"}', "not valid UTF-8"),
        ('["a", "b"]', "not an object"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, bad, problem):
    f = write(tmp_path / "bad.jsonl", [json.dumps({"question": "ok", "answer": "1"}), bad])
    with pytest.raises(DataError) as err:
        load_jsonl(f)
    assert f"{f}:2:" in str(err.value) and problem in str(err.value)
    with pytest.warns(UserWarning, match="skipped 1"):
        ex = load_jsonl(f, on_error="skip")
    assert len(ex) == 1 and len(ex.skipped) == 1 and ex.skipped[0].startswith(f"{f}:2:")


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_jsonl(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------- GSM8K, MATH, SFT, preferences
def test_gsm8k_loader(tmp_path):
    f = write(tmp_path / "gsm8k.jsonl", [
        json.dumps({"question": "Q1", "answer": "She sells 16 - 3 = <<16-3=13>>13.\n#### 1,300"}),
        json.dumps({"question": "Q2", "answer": "no final answer"}),
    ])
    with pytest.raises(DataError, match=r"gsm8k.jsonl:2: no '####'"):
        load_gsm8k(f)
    with pytest.warns(UserWarning, match="skipped 1"):
        ex = load_gsm8k(f, on_error="skip")
    assert ex[0].answer == "1300"
    assert ex[0].solution == "She sells 16 - 3 = 13.</think> <answer>1300</answer>"
    assert gsm8k_final_answer("x\n#### -5") == "-5"


def test_math_loader_nested_boxed(tmp_path):
    f = write(tmp_path / "math.jsonl", [
        json.dumps({"problem": "P", "solution": "First \\boxed{1}, finally $\\boxed{\\frac{1}{\\sqrt{2}}}$."}),
        json.dumps({"problem": "P2", "solution": "none"}),
    ])
    with pytest.raises(DataError, match=r"math.jsonl:2:.*boxed"):
        load_math(f)
    with pytest.warns(UserWarning, match="skipped 1"):
        assert load_math(f, on_error="skip")[0].answer == "\\frac{1}{\\sqrt{2}}"
        assert load_examples(str(f), on_error="skip")[0].answer == "\\frac{1}{\\sqrt{2}}"


def test_sft_and_preference_loaders(tmp_path):
    f = write(tmp_path / "sft.jsonl", [json.dumps({"prompt": "p", "response": "r", "ground_truth": "1"})])
    pairs = load_sft_pairs(f)
    assert (pairs[0].prompt, pairs[0].response, pairs[0].ground_truth) == ("p", "r", "1")
    g = write(tmp_path / "pref.jsonl", [json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}),
                                       json.dumps({"prompt": "p", "chosen": "a"})])
    with pytest.raises(DataError, match=r"pref.jsonl:2: missing field 'rejected'"):
        load_preferences(g)


def test_hf_datasets_clear_error_when_missing_or_offline():
    with pytest.raises(DataError, match="dataset 'openai/gsm8k'"):
        load_hf_dataset("openai/gsm8k", config="main")


# ---------------------------------------------------------------- templates
def test_r1_zero_template_exact_text():
    lines = R1_ZERO_PROMPT.split("\n")
    assert lines[0].startswith("A conversation between User and Assistant. The User asks a question")
    assert lines[0].endswith("i.e., <think> reasoning process here </think> <answer> answer here </answer>.")
    assert lines[1:] == ["User: {question}", "Assistant: <think>"]
    assert load_template("r1_zero").format("What is 1+1?").endswith("User: What is 1+1?\nAssistant: <think>")
    assert load_template("question_only").format("Q") == "Q"


def test_template_from_file_and_errors(tmp_path):
    (tmp_path / "t.txt").write_text("Solve: {question}\nUse \\boxed{}.\n")
    # read verbatim: the trailing newline stays (a chat prompt written in a file ends "assistant\n")
    assert load_template(str(tmp_path / "t.txt")).format("1+1") == "Solve: 1+1\nUse \\boxed{}.\n"
    (tmp_path / "bad.txt").write_text("no placeholder")
    with pytest.raises(TemplateError, match="question"):
        load_template(str(tmp_path / "bad.txt"))
    with pytest.raises(TemplateError, match="unknown prompt template"):
        load_template("r2_zero")


# ---------------------------------------------------------------- tasks
@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_tasks_deterministic_disjoint_and_verified(name):
    task = get_task(name, seed=7)
    a = task.examples("train", 200)
    b = get_task(name, seed=7).examples("train", 200)
    assert [(e.question, e.answer, e.solution) for e in a] == [(e.question, e.answer, e.solution) for e in b]
    assert [e.question for e in get_task(name, seed=8).examples("train", 50)] != [e.question for e in a[:50]]
    splits = {s: {e.question for e in task.examples(s, 60)} for s in ("train", "validation", "test")}
    splits["train"] |= {e.question for e in a}
    assert not splits["train"] & splits["test"] and not splits["train"] & splits["validation"]
    assert not splits["validation"] & splits["test"]
    assert all(split_of(q) == "test" for q in splits["test"])
    for e in a:  # correct demonstrations pass their own verifier
        assert task.reward_fn(e.solution, e.answer)["reward"] == 1.0


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_wrong_fraction_makes_that_share_of_demonstrations_wrong(name):
    task = get_task(name, seed=0, wrong_fraction=0.4)
    ex = task.examples("train", 500)
    wrong = [e for e in ex if task.reward_fn(e.solution, e.answer)["reward"] == 0.0]
    assert 0.3 < len(wrong) / len(ex) < 0.5
    assert all(not e.meta["solution_correct"] for e in wrong)
    assert all(task.reward_fn(e.solution, e.answer)["format_reward"] == 1.0 for e in ex)


def test_arithmetic_settings_and_errors():
    t = get_task("arithmetic", digits=2, num_ops=3, ops="+-*")
    e = t.examples("train", 20)
    assert all(t.reward_fn(x.solution, x.answer)["reward"] == 1.0 for x in e)
    assert any("*" in x.question for x in e)
    with pytest.raises(ValueError, match="wrong_fraction"):
        get_task("arithmetic", wrong_fraction=1.5)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("sudoku")
    with pytest.raises(ValueError, match="distinct"):
        get_task("arithmetic", digits=1, num_ops=1, ops="+").examples("test", 500)


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_wrong_solution_keeps_the_question_and_fails_the_verifier(name):
    import random

    task = get_task(name, seed=3)
    rng = random.Random(0)
    for e in task.examples("validation", 30):
        bad = task.wrong_solution(e, rng)
        assert bad != e.solution
        assert task.reward_fn(bad, e.answer) == {"reward": 0.0, "format_reward": 1.0, "answer_reward": 0.0}


# ---------------------------------------------------------------- the same seed, the same examples
# Recorded from the code before it moved out of ``grpolab/data/tasks/__init__.py``; the demo's
# numbers depend on these draws, so a change here is a change of every published figure.
ARITHMETIC_PINNED = [
    ("7+5+4", "16", "7+5=12 12+4=16</think> <answer>16</answer>", True),
    ("5+0+0", "5", "5+0=5 5+0=5</think> <answer>7</answer>", False),
    ("5-2+1", "4", "5-2=3 3+1=4</think> <answer>4</answer>", True),
    ("6+6+5", "17", "6+6=12 12+5=17</think> <answer>17</answer>", True),
    ("7+2-7", "2", "7+2=9 9-7=2</think> <answer>2</answer>", True),
]
COUNTDOWN_PINNED = [
    ("Use 9 9 12 to make 99", {"numbers": [9, 9, 12], "target": 99},
     "12*9=108 108-9=99</think> <answer>12*9-9-1</answer>", False),
    ("Use 17 19 10 to make 8", {"numbers": [17, 19, 10], "target": 8},
     "10+17=27 27-19=8</think> <answer>10+17-19+1</answer>", False),
    ("Use 8 6 16 to make 2", {"numbers": [8, 6, 16], "target": 2}, "16-6=10 10-8=2</think> <answer>16-6-8-1</answer>",
     False),
    ("Use 5 11 20 to make 35", {"numbers": [5, 11, 20], "target": 35},
     "11*5=55 55-20=35</think> <answer>11*5-20-1</answer>", False),
    ("Use 17 1 7 to make 10", {"numbers": [17, 1, 7], "target": 10}, "17/1=17 17-7=10</think> <answer>17/1-7</answer>",
     True),
]


@pytest.mark.parametrize(
    "name,kwargs,pinned",
    [
        ("arithmetic", dict(digits=1, num_ops=2, ops="+-", wrong_fraction=0.5, wrong_kind="answer"), ARITHMETIC_PINNED),
        ("countdown", dict(wrong_fraction=0.5), COUNTDOWN_PINNED),
    ],
)
def test_seed_zero_gives_the_recorded_examples(name, kwargs, pinned):
    ex = get_task(name, seed=0, **kwargs).examples("train", 5)
    assert [(e.question, e.answer, e.solution, e.meta["solution_correct"]) for e in ex] == pinned


def test_step_errors_and_wrong_solutions_are_pinned_too():
    import random

    t = get_task("arithmetic", seed=3, digits=2, num_ops=3, ops="+-*", wrong_fraction=0.5, wrong_kind="step")
    assert [(e.question, e.answer, e.solution) for e in t.examples("validation", 3)] == [
        ("44-13+21*67", "1438", "21*67=1407 44-13=31 31+1407=1438</think> <answer>1438</answer>"),
        ("36*84*71+21", "214725", "36*84=3024 3024*71=214704 214704+21=214725</think> <answer>214725</answer>"),
        ("32-67-33*24", "-827", "33*24=792 32-67=-35 -35-792=-826</think> <answer>-826</answer>"),
    ]
    def rejected(name):  # DPO draws rejected answers from tasks with wrong_fraction=0
        task, rng = get_task(name, seed=0), random.Random(0)
        return [task.wrong_solution(e, rng) for e in task.examples("test", 3)]

    assert rejected("arithmetic") + rejected("countdown") == [
        "2-4=-2 -2-8=-10</think> <answer>-8</answer>",
        "8+4=12 12-8=4</think> <answer>6</answer>",
        "0+5=5 5+8=13</think> <answer>11</answer>",
        "10*15=150 150+7=157</think> <answer>10*15+7-1</answer>",
        "14+4=18 18+11=29</think> <answer>14+4+11-1</answer>",
        "11+7=18 18/3=6</think> <answer>(11+7)/3+1</answer>",
    ]


# ---------------------------------------------------------------- package layout
def test_package_init_files_only_re_export():
    import ast
    import importlib
    import inspect

    for package in ("grpolab.data", "grpolab.data.tasks", "grpolab.data.prompts"):
        tree = ast.parse(inspect.getsource(importlib.import_module(package)))
        for node in tree.body:
            is_docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            is_all = isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"]
            assert is_docstring or is_all or isinstance(node, (ast.Import, ast.ImportFrom)), (
                f"{package}/__init__.py line {node.lineno}: logic belongs in a named module"
            )


def test_public_names_stay_importable_from_the_packages():
    import grpolab.data as data
    import grpolab.data.prompts as prompts
    import grpolab.data.tasks as tasks
    from grpolab.data.prompts.templates import load_template as from_module
    from grpolab.data.tasks.arithmetic import ArithmeticTask
    from grpolab.data.tasks.base import Task
    from grpolab.data.tasks.countdown import CountdownTask
    from grpolab.data.tasks.registry import TASKS

    for module in (data, prompts, tasks):
        assert all(hasattr(module, name) for name in module.__all__)
    assert {"TASKS", "ArithmeticTask", "CountdownTask", "get_task", "split_of", "Task", "SPLITS"} <= set(tasks.__all__)
    assert {"BUILTIN_TEMPLATES", "PromptTemplate", "TemplateError", "load_template", "R1_ZERO_PROMPT"} <= set(
        prompts.__all__
    )
    from grpolab.data.tasks.retrieval import RetrievalTask

    assert data.load_template is from_module
    assert TASKS == {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "retrieval": RetrievalTask}
    assert issubclass(ArithmeticTask, Task) and issubclass(CountdownTask, Task)
    assert data.get_task("countdown", seed=1).examples("test", 2) == tasks.get_task("countdown", seed=1).examples(
        "test", 2
    )
