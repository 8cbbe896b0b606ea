"""reasoning-gym tasks (``task: rg:NAME``): deterministic items, disjoint splits, the dataset's own
``score_answer`` as the reward (full credit only; hedges score 0) in the supervised workers, one-line
errors, and a GRPO step on one. Three generators: an arithmetic one, a word problem and a puzzle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install -e '.[gym]')")

from grpolab.data import get_task  # noqa: E402
from grpolab.rewards import RewardScorer  # noqa: E402
from grpolab.rewards.gym import (  # noqa: E402
    rg_reward_fn,
    rg_reward_fn_lenient,
    rg_stated_answer_reward_fn,
    rg_whole_response_reward_fn,
)
from grpolab.training.inputs import task_or_file  # noqa: E402

GENERATORS = {  # one arithmetic, one word problem, one puzzle
    "basic_arithmetic": {"min_digits": 1, "max_digits": 2},
    "gsm_symbolic": {},
    "mini_sudoku": {},
}


@pytest.mark.parametrize("name", GENERATORS)
def test_items_are_deterministic_per_seed_and_splits_never_share_one(name):
    task = get_task(f"rg:{name}", seed=3, **GENERATORS[name])
    splits = {s: task.examples(s, 6) for s in ("train", "validation", "test")}
    again = get_task(f"rg:{name}", seed=3, **GENERATORS[name]).examples("test", 6)
    other = get_task(f"rg:{name}", seed=4, **GENERATORS[name]).examples("test", 6)
    assert [e.question for e in again] == [e.question for e in splits["test"]]
    assert [e.question for e in other] != [e.question for e in splits["test"]]
    assert [e.question for e in task.examples("test", 3)] == [e.question for e in splits["test"][:3]]
    questions = [{e.question for e in xs} for xs in splits.values()]
    assert all(len(q) == 6 for q in questions)
    assert not (questions[0] & questions[1]) and not (questions[0] & questions[2]) and not (questions[1] & questions[2])
    assert splits["test"][0].answer["dataset"] == name and splits["test"][0].meta["source"] == f"rg:{name}:test:0"


@pytest.mark.parametrize("name", GENERATORS)
def test_a_correct_answer_scores_1_and_a_wrong_or_hedged_one_0(name):
    example = get_task(f"rg:{name}", seed=0, **GENERATORS[name]).examples("test", 1)[0]
    gold = example.answer["entry"]["answer"]
    right = rg_reward_fn(f"work</think> <answer>{gold}</answer>", example.answer)
    assert right["reward"] == right["answer_reward"] == right["format_reward"] == 1.0
    assert (
        rg_reward_fn(f"work</think> <answer> {gold}\n</answer>", example.answer)["reward"] == 1.0
    )  # spaces are not wrong
    assert rg_reward_fn("work</think> <answer>12345 x</answer>", example.answer)["reward"] == 0.0
    assert rg_reward_fn(f"work</think> <answer>maybe {gold} or 7</answer>", example.answer)["reward"] == 0.0
    assert rg_reward_fn(f"{gold}", example.answer)["format_reward"] == 0.0  # no tags under an R1 template
    assert rg_reward_fn_lenient(f"work</think>\n<answer>{gold}</answer>", example.answer)["reward"] == 1.0
    assert rg_whole_response_reward_fn(f"{gold}", example.answer)["reward"] == 1.0


def test_a_prose_reply_is_scored_by_its_stated_number():
    """configs/real/smollm2_135m_grpo_rg_chain_sum.yaml: SmolLM2 answers "The answer is 5."; the whole
    response scores 0 there, its last number is what the dataset's score_answer grades."""
    examples = get_task("rg:chain_sum", seed=0, options={"min_terms": 2, "max_terms": 3, "min_digits": 1,
                                                         "max_digits": 1}).examples("test", 40)
    example = next(e for e in examples if int(e.answer["entry"]["answer"]) < 0)  # a negative sum: the sign is read
    gold = example.answer["entry"]["answer"]
    assert rg_whole_response_reward_fn(f"The answer is {gold}.", example.answer)["reward"] == 0.0
    assert rg_stated_answer_reward_fn(f"The answer is {gold}.", example.answer)["reward"] == 1.0
    assert rg_stated_answer_reward_fn(f"{gold} + 1 = {int(gold) + 1}", example.answer)["reward"] == 0.0  # the last one
    assert rg_stated_answer_reward_fn(f"It is \\boxed{{{gold}}}, not 3", example.answer)["reward"] == 1.0
    assert rg_stated_answer_reward_fn("no idea", example.answer)["reward"] == 0.0
    assert rg_stated_answer_reward_fn(f"maybe {gold}", example.answer)["reward"] == 1.0  # the number, not the hedge


def test_basic_arithmetic_in_the_real_config_is_scored_by_the_last_number():
    """configs/real/smollm2_135m_grpo_rg_basic_arithmetic.yaml: its task options give one + or - between
    two numbers in rg's own phrasing, and the base model's explanation ending on an operand scores 0."""
    import yaml

    cfg = yaml.safe_load((Path(__file__).parents[2] / "configs/real/smollm2_135m_grpo_rg_basic_arithmetic.yaml")
                         .read_text())
    examples = get_task(cfg["task"], seed=0, options=cfg["task_options"]).examples("test", 200)
    parsed = [(e, e.answer["entry"]["metadata"]["expression"].split()) for e in examples]
    for e, terms in parsed:
        assert e.question.startswith("Calculate ") and len(terms) == 3 and terms[1] in ("+", "-")
    e, (a, _, b) = next((e, terms) for e, terms in parsed if terms[1] == "-")
    gold = e.answer["entry"]["answer"]
    assert str(int(a) - int(b)) == gold
    assert rg_stated_answer_reward_fn(f"{a} - {b} = {gold}", e.answer)["reward"] == 1.0
    assert rg_stated_answer_reward_fn(f"To calculate {a} - {b}, you simply subtract {b} from {a}", e.answer)[
        "reward"] == 0.0


def test_partial_credit_is_reported_but_not_rewarded():
    example = get_task("rg:gsm_symbolic", seed=0).examples("test", 1)[0]
    wrong = str(int(example.answer["entry"]["answer"]) + 1)
    scores = rg_reward_fn(f"w</think> <answer>{wrong}</answer>", example.answer)
    assert 0.0 < scores["rg_score"] < 1.0 and scores["reward"] == 0.0  # gsm_symbolic gives 0.01 to a wrong number


def test_the_reward_runs_in_a_supervised_worker_like_any_user_reward():
    example = get_task("rg:basic_arithmetic", seed=0).examples("test", 1)[0]
    gold = example.answer["entry"]["answer"]
    with RewardScorer(rg_reward_fn, timeout_s=60) as scorer:
        assert scorer.mode == "process"
        scores = scorer.score([f"w</think> <answer>{gold}</answer>", "w</think> <answer>x</answer>"],
                              [example.answer] * 2)
    assert [s["reward"] for s in scores] == [1.0, 0.0] and scorer.errors == 0


def test_templates_choose_tags_or_the_whole_response():
    _, r1, tagged = task_or_file("rg:basic_arithmetic", 1)
    _, template, whole = task_or_file("rg:basic_arithmetic", 1, prompt_template="question_only")
    assert tagged is rg_reward_fn and "<answer>" in r1.text  # the default template (r1_zero) asks for tags
    assert whole is rg_whole_response_reward_fn and template.text == "{question}"


def test_unknown_dataset_and_option_are_one_line_errors_naming_what_exists():
    with pytest.raises(ValueError) as unknown:
        get_task("rg:no_such_generator")
    assert ("\n" not in str(unknown.value)
            and "basic_arithmetic" in str(unknown.value)
            and "gsm_symbolic" in str(unknown.value))
    with pytest.raises(ValueError) as option:
        get_task("rg:basic_arithmetic", no_such_field=1)
    assert "\n" not in str(option.value) and "min_digits" in str(option.value)


def test_a_seed_in_task_options_is_the_generators_seed_as_given(grpo_config):
    # RG08: the run's seed is spread apart (seed x 1,000,003) unless task_options give one
    import reasoning_gym

    options = {"min_digits": 1, "max_digits": 2}
    given = get_task("rg:basic_arithmetic", seed=3, options={**options, "seed": 5})
    assert given.options["seed"] == 5 and get_task("rg:basic_arithmetic", seed=3).options["seed"] == 3 * 1_000_003
    direct = reasoning_gym.create_dataset("basic_arithmetic", **options, seed=5, size=100_000)
    test = given.examples("test", 2)
    assert [e.question for e in test] == [direct[e.meta["rg_index"]]["question"] for e in test]
    cfg = grpo_config(task="rg:basic_arithmetic", task_options={**options, "seed": 5}, task_train_size=3)
    from grpolab.training.inputs import load_inputs

    assert [e.question for e in load_inputs(cfg).train] == [e.question for e in given.examples("train", 3)]  # grpo
    examples, _, _ = task_or_file("rg:basic_arithmetic", 2, seed=3, task_options={**options, "seed": 5})
    assert [e.question for e in examples] == [e.question for e in test]  # eval


@pytest.mark.parametrize("options,says", [
    ({"min_digits": 1, "max_digits": 2.5}, "of rg:basic_arithmetic: max_digits must be an integer, got 2.5"),
    ({"size": -5}, "task_options of rg:basic_arithmetic: size must be at least 1, got -5"),
    ({"size": 0}, "size must be at least 1, got 0"),
    ({"size": "abc"}, "task_options of rg:basic_arithmetic: size must be an integer, got 'abc'"),
    ({"seed": None}, "seed must be an integer, got None"),
    ({"allow_parentheses": "yes"}, "allow_parentheses must be true or false, got 'yes'"),
    ({"format_style": "fancy"}, "format_style must be one of 'simple', 'natural', got 'fancy'"),
    ({"min_digits": 1, "max_digits": 1, "operators": ["/"]},
     "task rg:basic_arithmetic: the generator failed on item 0 (IndexError: Cannot choose from an empty sequence); "
     "check its task_options"),
])
def test_a_wrong_option_or_a_failing_generator_is_one_line_naming_the_task(options, says):
    with pytest.raises(ValueError) as err:
        get_task("rg:basic_arithmetic", options=options).examples("test", 2)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_an_empty_dataset_name_and_eval_with_a_wrong_option_are_one_line(tmp_path):
    from typer.testing import CliRunner

    from grpolab import cli

    with pytest.raises(ValueError, match=r"^task 'rg:' names no reasoning-gym dataset; give one after 'rg:'"):
        get_task("rg:")
    out = CliRunner().invoke(cli.app, ["eval", "--model", "embedded:tiny", "--data", "rg:basic_arithmetic",
                                       "--task-option", "size=abc", "--out", str(tmp_path / "eval")])  # RG10
    assert out.exit_code == 2 and out.stderr.strip().splitlines() == [
        "grpolab: error: task_options of rg:basic_arithmetic: size must be an integer, got 'abc'"], out.stderr


def test_without_reasoning_gym_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(ValueError, match=r"pip install -e '\.\[gym\]'") as err:
        get_task("rg:basic_arithmetic")
    assert "\n" not in str(err.value)


def test_a_grpo_step_runs_on_a_reasoning_gym_task(grpo_config):
    from grpolab.algorithms.grpo import train_grpo
    from grpolab.training.metric_logging import read_metrics

    cfg = grpo_config(task="rg:basic_arithmetic", task_options={"min_digits": 1, "max_digits": 1, "max_terms": 2},
                      n_grpo_steps=1, rollout_batch_size=8, train_batch_size=8, task_train_size=8, eval_examples=2,
                      reward_timeout_s=60)
    result = train_grpo(cfg)
    rows = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert len(rows) == 1 and rows[0]["health/reward_errors"] == 0 and "train/reward_rg_score" in rows[0]
