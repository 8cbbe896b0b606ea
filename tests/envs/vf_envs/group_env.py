"""A single-turn verifiers environment whose rubric ranks a group: "What is a + b?" (``sum_env``'s
rows) with ``correct_answer`` (per response, weight 1.0) and ``shortest_correct`` (a group reward
function, weight 0.5): 1.0 for each correct response as short as the group's shortest correct one."""

import datasets
import verifiers as vf

from tests.envs.vf_envs.sum_env import SYSTEM_PROMPT, _text, correct_answer, rows


def shortest_correct(completions, answers) -> list[float]:
    right = [correct_answer(c, a) == 1.0 for c, a in zip(completions, answers)]
    lengths = [len(_text(c)) for c, ok in zip(completions, right) if ok]
    best = min(lengths) if lengths else None
    return [1.0 if ok and len(_text(c)) == best else 0.0 for c, ok in zip(completions, right)]


def load_environment(n: int = 64) -> vf.Environment:
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows(n)), system_prompt=SYSTEM_PROMPT,
                            rubric=vf.Rubric(funcs=[correct_answer, shortest_correct], weights=[1.0, 0.5]))
