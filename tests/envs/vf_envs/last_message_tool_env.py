"""A verifiers ``ToolEnv`` of one turn (``max_turns=1``) whose rubric reads the completion's last
message, whatever its role (the pattern of ``configs/envs/vf_arithmetic.py``): verifiers ends a
rollout that calls a tool in its last turn before running the tool, so such a rollout scores 0.
``CALLS`` records the tool's calls in this process."""

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


def last_message_is_the_answer(completion, answer) -> float:
    return 1.0 if str(completion[-1].get("content") or "").strip() == answer else 0.0


def load_environment() -> vf.Environment:
    rows = [{"question": "What is 12+30?", "answer": "42"}, {"question": "What is 50-8?", "answer": "42"}]
    data = datasets.Dataset.from_list(rows)
    return vf.ToolEnv(tools=[calculate], dataset=data, eval_dataset=data, max_turns=1,
                      rubric=vf.Rubric(funcs=[last_message_is_the_answer]))
