"""A verifiers ``ToolEnv`` with one Python tool, ``calculate``: the questions of the function-calling
tests' taught model, rewarded when the last answer is the sum (``correct_answer``); verifiers adds a
``total_tool_calls`` metric of its own. ``CALLS`` counts the tool's calls in this process."""

import datasets
import verifiers as vf

CALLS = []


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. 12+30.
    """
    CALLS.append(expression)
    a, op, b = next((expression.partition(o) for o in "+-*" if o in expression))
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


def correct_answer(completion, answer) -> float:
    last = [m for m in completion if m["role"] == "assistant"][-1]
    return 1.0 if str(last["content"] or "").strip() == answer else 0.0


def load_environment() -> vf.Environment:
    rows = [{"question": "What is 12+30?", "answer": "42"}, {"question": "What is 50-8?", "answer": "42"}]
    data = datasets.Dataset.from_list(rows)  # an eval_dataset: the train split is every row
    return vf.ToolEnv(tools=[calculate], dataset=data, eval_dataset=data, max_turns=3,
                      rubric=vf.Rubric(funcs=[correct_answer]))
