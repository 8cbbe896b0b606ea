"""A single-turn verifiers environment with several weighted functions and its parser's format
function (the C5-6 report's rubric): ``correct`` (weight 1.0): the parsed ``<answer>`` is the answer;
``short`` (0.5): the completion is at most 24 characters; the ``XMLParser``'s format function (0.2)."""

import datasets
import verifiers as vf

PARSER = vf.XMLParser(["answer"], answer_field="answer")


def correct(completion, answer) -> float:
    return 1.0 if (PARSER.parse_answer(completion) or "").strip() == answer else 0.0


def short(completion) -> float:
    return 1.0 if len(str(completion[-1]["content"] or "")) <= 24 else 0.0


def load_environment() -> vf.Environment:
    rows = [{"question": f"What is {i}+{42 - i}?", "answer": "42"} for i in range(6)]
    rubric = vf.Rubric(funcs=[correct, short, PARSER.get_format_reward_func()], weights=[1.0, 0.5, 0.2],
                       parser=PARSER)
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows), parser=PARSER, rubric=rubric)
