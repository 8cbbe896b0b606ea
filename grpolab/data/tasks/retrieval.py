"""Questions about invented entities whose facts live only in a generated corpus: a task that needs
retrieval (``grpolab.envs``: ``<search>`` over the corpus, or the passages in the prompt).

The world is drawn from the seed: ``num_entities`` invented places with 4-letter names ("Tiva"), each
with a ruler, a river and a mayor (and a capital) (invented 5-letter names, unique in the world). Every
fact is one line of the corpus, ``Tiva ruler: Mokek``; a question is ``ruler of Tiva?``.
Everything is short and templated so that a character-level model a million parameters big can
learn, in a few minutes of CPU, the one skill the task tests: copy the entity from the question
into the query, and the value from the result into the answer. Nothing about a held-out entity
can be in a model's weights, so without retrieval the accuracy is chance (about zero).

A worked demonstration (no prose between the tags; the compact template opens ``<think>``)::

    <search>Tiva ruler</search><result>Tiva ruler: Mokek</result></think> <answer>Mokek</answer>

The observation written in it is the gold passage (what a top-1 search returns); the environment
replays the call through the live tool when it builds SFT data (``envs.replay_demonstrations``).
``wrong_fraction`` of the demonstrations are imperfect, ``wrong_kind``: ``"answer"`` (the right
search, then an invented name that is not in the result — the imperfection the tool demo uses,
as the arithmetic demo's wrong final answers), ``"typo"`` (the result's value copied with one
letter changed, a careless copy), ``"search"``
(the query names another entity, so the answer copied from its passage is wrong) or ``"mixed"``
(a third each).

Splits are fixed by a hash of the entity (``split_of``): a held-out entity's questions are all
held out, so no test fact is ever seen in training. The verifier is exact match of the last
``<answer>`` block after normalisation (case, surrounding spaces and punctuation), R1-Zero format.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...rewards.verifiers import extract_r1_zero_answer, reward_dict
from ..datasets import Example
from .base import SPLITS, Task, split_of

# relation -> (question, passage); {e} the entity, {v} the value. The query is "{e} {relation}".
# The default relations' words have the same length, so a passage in a retrieval-augmented prompt
# sits at the same distance from the answer whatever the question asks.
RELATIONS: dict[str, tuple[str, str]] = {
    "ruler": ("ruler of {e}?", "{e} ruler: {v}"),
    "river": ("river of {e}?", "{e} river: {v}"),
    "mayor": ("mayor of {e}?", "{e} mayor: {v}"),
    "capital": ("capital of {e}?", "{e} capital: {v}"),
}
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
# fixed shapes: every entity has 4 letters and every value 5, so where a name sits relative to
# where it is copied to never changes (a copy the tiny model learns in a few hundred steps)
ENTITY_SHAPE, VALUE_SHAPE = "CVCV", "CVCVC"
WRONG_KINDS = ("answer", "typo", "search", "mixed")


def normalize_answer_text(text: str) -> str:
    """Case-folded, surrounding spaces and punctuation removed: ``" Mokek. "`` -> ``mokek``."""
    return text.strip().strip(string.punctuation + " ").casefold()


def retrieval_reward_fn(response: str, ground_truth: Any, *, lenient_format: bool = False) -> dict[str, float]:
    """R1-Zero format, and the last answer block equals ``ground_truth`` after normalisation."""
    answer = extract_r1_zero_answer(response, lenient_format)
    if answer is None:
        return reward_dict(False, False)
    return reward_dict(True, normalize_answer_text(answer) == normalize_answer_text(str(ground_truth)))


def invented_name(rng: random.Random, shape: str = VALUE_SHAPE) -> str:
    """A pronounceable invented name of ``shape`` (C: a consonant, V: a vowel), capitalised."""
    return "".join(rng.choice(_CONSONANTS if c == "C" else _VOWELS) for c in shape).capitalize()


@dataclass
class RetrievalTask(Task):
    """Invented-entity questions answered from a generated corpus (see the module docstring)."""

    num_entities: int = 1000
    relations: str = "ruler,river,mayor"
    wrong_kind: str = "answer"
    name = "retrieval"
    option_bounds = {**Task.option_bounds, "num_entities": (10, 2000)}
    option_choices = {"wrong_kind": WRONG_KINDS}

    def __post_init__(self):
        self.check_settings()
        self.relation_names = [r.strip() for r in self.relations.split(",") if r.strip()]
        unknown = [r for r in self.relation_names if r not in RELATIONS]
        if unknown or not self.relation_names:
            raise ValueError(f"task_options of retrieval: relations must be a comma-separated list of "
                             f"{', '.join(RELATIONS)}, got {self.relations!r}")
        self.reward_fn = retrieval_reward_fn
        self.world = self._world()

    def _world(self) -> dict[str, dict[str, str]]:
        """entity -> relation -> value, drawn from the seed; every name is unique in the world (and
        none is a relation's word, which would confuse the search)."""
        rng = random.Random(f"{self.name}:world:{self.seed}")
        used: set[str] = {r.capitalize() for r in RELATIONS}

        def fresh(shape: str) -> str:
            while True:
                name = invented_name(rng, shape)
                if name not in used:
                    used.add(name)
                    return name

        world = {}
        for _ in range(self.num_entities):
            entity = fresh(ENTITY_SHAPE)
            world[entity] = {r: fresh(VALUE_SHAPE) for r in RELATIONS}
        return world

    # ---------------------------------------------------------------- the corpus
    def passage(self, entity: str, relation: str) -> str:
        return RELATIONS[relation][1].format(e=entity, v=self.world[entity][relation])

    def corpus(self) -> list[str]:
        """Every fact of every entity (all splits), one passage each, in world order."""
        return [self.passage(e, r) for e in self.world for r in self.relation_names]

    def write_corpus(self, path: str | Path) -> Path:
        """The corpus as JSONL (``{"id", "text"}`` per line), the format ``envs.load_corpus`` reads."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = (json.dumps({"id": i, "text": t}) for i, t in enumerate(self.corpus()))
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    # ---------------------------------------------------------------- questions
    @staticmethod
    def query(entity: str, relation: str) -> str:
        """The search a demonstration writes: the entity and the relation."""
        return f"{entity} {relation}"

    def demonstration(self, entity: str, relation: str, answer: str, searched: str) -> str:
        """Search for ``searched``'s fact, read its passage, answer ``answer``."""
        return (f"<search>{self.query(searched, relation)}</search><result>{self.passage(searched, relation)}</result>"
                f"</think> <answer>{answer}</answer>")

    def examples(self, split: str, n: int) -> list[Example]:
        """``n`` questions of ``split`` (entities hashed into splits); the first ``k`` are the same
        whatever ``n`` is, and whether a demonstration is imperfect depends on the question only."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        pairs = [(e, r) for e in self.world if split_of(e) == split for r in self.relation_names]
        if n > len(pairs):
            raise ValueError(f"task 'retrieval' has {len(pairs)} {split} questions at these settings, fewer than {n}")
        random.Random(f"{self.name}:{self.seed}:{split}").shuffle(pairs)
        return [self._example(e, r, split, i) for i, (e, r) in enumerate(pairs[:n])]

    def _example(self, entity: str, relation: str, split: str, index: int) -> Example:
        rng = random.Random(f"{self.name}:{self.seed}:{entity}:{relation}")
        value = self.world[entity][relation]
        wrong = rng.random() < self.wrong_fraction
        kind = self.wrong_kind if self.wrong_kind != "mixed" else rng.choice(["typo", "answer", "search"])
        if wrong and kind == "search":
            other = rng.choice([e for e in rng.sample(list(self.world), 3) if e != entity])
            solution = self.demonstration(entity, relation, self.world[other][relation], other)
        elif wrong and kind == "typo":
            solution = self.demonstration(entity, relation, self._typo(value, rng), entity)
        elif wrong:
            solution = self.demonstration(entity, relation, self._wrong_value(value, rng), entity)
        else:
            solution = self.demonstration(entity, relation, value, entity)
        question = RELATIONS[relation][0].format(e=entity)
        meta = {"split": split, "solution_correct": not wrong, "source": f"task:{self.name}:{split}:{index}",
                "entity": entity, "relation": relation, "query": self.query(entity, relation),
                "passage": self.passage(entity, relation)}
        return Example(question, value, solution, meta)

    @staticmethod
    def _wrong_value(value: str, rng: random.Random) -> str:
        """An invented name that is not ``value`` (drawn afresh: not copied from anywhere)."""
        while True:
            name = invented_name(rng, VALUE_SHAPE)
            if name != value:
                return name

    @staticmethod
    def _typo(value: str, rng: random.Random) -> str:
        """``value`` with one letter changed (a consonant for a consonant, a vowel for a vowel, the
        case kept): a careless copy, the same shape as the right one."""
        i = rng.randrange(len(value))
        letters = _VOWELS if value[i].lower() in _VOWELS else _CONSONANTS
        new = rng.choice([c for c in letters if c != value[i].lower()])
        return value[:i] + (new.upper() if value[i].isupper() else new) + value[i + 1:]

    def wrong_solution(self, example: Example, rng: random.Random) -> str:
        """The right search, then a wrong answer (for preference pairs)."""
        entity, relation = example.meta["entity"], example.meta["relation"]
        return self.demonstration(entity, relation, self._wrong_value(str(example.answer), rng), entity)
