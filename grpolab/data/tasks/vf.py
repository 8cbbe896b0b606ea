"""A ``verifiers`` environment as a grpolab task (``env: {verifiers: NAME, args: {...}}``): its
dataset's rows are the questions, its rubric the reward (``grpolab.rewards.vf_rubric``); what runs
between turns, if anything, is built by ``grpolab.envs.vf``.

Each row becomes an ``Example`` whose question is the row's ``prompt`` (chat messages: the chat
template renders them as they are) and whose answer is the plain-data ground truth the reward
workers rebuild the environment and its state from (``{"env", "args", "row"}``: the row whole).

Splits: an environment with an ``eval_dataset`` trains on ``dataset`` and validates and tests on
``eval_dataset`` (verifiers has one evaluation set, so validation and test are the same rows); one
without splits ``dataset`` by the hash of each prompt's text (``split_of``: 80 % train, 10 %
validation, 10 % test), so no row is in two splits. Rows keep the dataset's order (the trainer's
sampler shuffles them by seed): the first ``k`` of a split are the same whatever ``n`` is asked for.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ...rewards.vf_reward import VfRubric
from ...rewards.vf_rubric import environment_kind, load_vf_environment, tool_functions, vf_source
from ...rewards.vf_v1 import V1Taskset
from ..datasets import Example
from .base import SPLITS, plain, split_of


class VerifiersTask:
    """A verifiers environment's dataset, drawn from like the embedded tasks: ``examples(split, n)``."""

    default_template = "chat"

    def __init__(self, spec: str, args: dict[str, Any] | None = None, seed: int = 0):
        """``spec``: an installed environment's name, a module or a ``.py`` file defining
        ``load_environment``; ``args``: its keyword arguments. ``seed`` is kept for the task
        interface: the rows are the dataset's, in its order."""
        self.source = vf_source(spec)  # a file by its absolute path: what the ground truth names
        self.spec, self.args, self.seed = spec, dict(args or {}), seed
        self.name = f"vf:{spec}"
        self.environment = load_vf_environment(self.source, self.args)
        # the rubric bound to this environment (data never chooses one), scoring a group at a time if it asks to
        groups = self.environment.has_group_rewards if isinstance(self.environment, V1Taskset) else (
            self.environment.rubric.has_group_rewards)
        self.reward_fn = VfRubric(self.source, self.args, scores_groups=groups)
        self.kind = environment_kind(self.environment)
        self._rows: dict[str, list[tuple[int, dict]]] = {}

    def rows(self, split: str) -> list[tuple[int, dict]]:
        """``(index in its dataset, row)`` of every row of ``split``, in the dataset's order."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        if split not in self._rows:
            env = self.environment
            train, evals = env.build_dataset(), env.build_eval_dataset()
            if evals is not None:
                data = train if split == "train" else evals
                self._rows[split] = [] if data is None else list(enumerate(data))
            else:
                self._rows[split] = [(i, row) for i, row in enumerate(train or [])
                                     if split_of(_prompt_text(row.get("prompt"))) == split]
        return self._rows[split]

    def size(self, split: str) -> int:
        """How many rows ``split`` has."""
        return len(self.rows(split))

    def examples(self, split: str, n: int) -> list[Example]:
        """The first ``n`` rows of ``split``; fewer there is one line saying how many."""
        rows = self.rows(split)
        if len(rows) < n:
            where = "eval_dataset" if split != "train" and self.environment.eval_dataset is not None else "dataset"
            raise ValueError(f"task {self.name!r} has {len(rows)} {split} rows (its {where}), fewer than the {n} "
                             f"asked (task_train_size, eval_examples): ask for at most {len(rows)}")
        out = []
        for index, row in rows[:n]:
            prompt = row.get("prompt")
            if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
                raise ValueError(f"task {self.name!r}: {split} row {index} has no prompt messages (got "
                                 f"{type(prompt).__name__})")
            truth = {"env": self.source, "args": self.args, "row": plain(row)}
            out.append(Example([_message(m) for m in prompt], truth, None,
                               {"split": split, "source": f"{self.name}:{split}:{index}", "vf_index": index}))
        return out

    def tool_functions(self) -> dict[str, Callable]:
        """A tool environment's Python functions by the names the model calls them ({} for others)."""
        return tool_functions(self.environment)


def _prompt_text(prompt: Any) -> str:
    """The text a row's split is hashed from: its messages as JSON (or the prompt string)."""
    return prompt if isinstance(prompt, str) else json.dumps(plain(prompt), sort_keys=True)


def _message(message: dict) -> dict:
    """A prompt message for the chat template: without the ``None`` fields Arrow fills in (a column
    of messages has every key any message has)."""
    return {k: v for k, v in message.items() if v is not None or k == "content"}

