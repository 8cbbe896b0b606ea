"""reasoning-gym tasks (``task: rg:NAME``): the field's procedural generators, nothing downloaded.

``task_options`` go to the generator's config (``size``, ``seed``, its difficulty fields, e.g.
``min_digits``), checked first against its fields' names and types (``options.check_options``: one
line naming the option, as for the embedded tasks; a generator that still fails on an item is one
line naming the task and the item); the item at index ``i`` of a generator is fixed by its seed.
Splits never share an item: items are drawn in index order and each is kept by the split its
question hashes to (``split_of``: 10 % test, 10 % validation, 80 % train; duplicates dropped), as
for the embedded tasks — so the first ``k`` items of a split are the same whatever ``n`` is asked for. The
generator's ``size`` bounds the indices drawn (default 100,000). reasoning-gym draws item ``i``
from ``Random(seed + i)``, so seeds 3 and 4 would give the same items shifted by one: the run's
``seed`` becomes the generator's seed ``seed * 1,000,003`` (streams that do not overlap), unless
``task_options`` gives ``seed`` itself, which is used as it is.

Rewards are the dataset's own ``score_answer`` (``grpolab.rewards.gym``), run in the supervised
reward workers like any non-built-in reward. There are no worked solutions (``solution`` is None):
SFT and DPO need another source of demonstrations.
"""

from __future__ import annotations

import typing
from typing import Any, Mapping

from ...rewards.gym import make_rg_dataset, require_reasoning_gym, rg_reward_fn, rg_whole_response_reward_fn
from ..datasets import Example
from .base import SPLITS, plain, split_of
from .options import check_options

DEFAULT_SIZE = 100_000
SEED_STRIDE = 1_000_003  # > any size drawn from: the item streams of two run seeds never overlap


class ReasoningGymTask:
    """A reasoning-gym generator as a grpolab task: ``examples(split, n)`` like the embedded ones."""

    default_template = "r1_zero"
    reward_fn = staticmethod(rg_reward_fn)
    whole_response_reward_fn = staticmethod(rg_whole_response_reward_fn)  # chat templates without tags

    def __init__(self, dataset: str, seed: int = 0, options: Mapping[str, Any] | None = None):
        """``options``: the generator's config fields; a ``seed`` among them is used as it is."""
        self.dataset = dataset
        self.name = f"rg:{dataset}"
        self.options = {"seed": seed * SEED_STRIDE, "size": DEFAULT_SIZE, **(options or {})}
        check_generator_options(dataset, self.options)
        self.generator = make_rg_dataset(dataset, self.options)  # one line for a bad name or option

    def examples(self, split: str, n: int) -> list[Example]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        out, seen = [], set()
        size = len(self.generator)
        for index in range(size):
            if len(out) >= n:
                break
            entry = self._item(index)
            question = entry["question"]
            if question in seen or split_of(question) != split:
                continue
            seen.add(question)
            truth = {"dataset": self.dataset, "options": self.options, "entry": plain(entry)}
            out.append(Example(question, truth, None, {"split": split, "source": f"{self.name}:{split}:{len(out)}",
                                                       "rg_index": index}))
        if len(out) < n:
            raise ValueError(f"task {self.name!r} has fewer than {n} distinct {split} questions in its {size} items "
                             "(raise task_options.size, or ask for fewer)")
        return out

    def _item(self, index: int) -> dict:
        """Item ``index``; a generator that fails on it (its own code, with these options) is one line
        naming the task, the item and the options, not its traceback."""
        try:
            entry = self.generator[index]
            if not isinstance(entry, dict) or not isinstance(entry.get("question"), str):
                raise TypeError(f"an item without a 'question' string ({type(entry).__name__})")
            return entry
        except Exception as exc:  # noqa: BLE001 - third-party generator code: any failure is the options'
            first = (str(exc).strip().splitlines() or [""])[0]
            given = {k: v for k, v in self.options.items() if (k, v) != ("size", DEFAULT_SIZE)}
            raise ValueError(f"task {self.name}: the generator failed on item {index} "
                             f"({type(exc).__name__}: {first}); check its task_options {given}") from None


def check_generator_options(dataset: str, options: Mapping[str, Any]) -> None:
    """The options' names, types and bounds against the generator's config class (one line naming
    ``rg:dataset`` and the option); a ``seed`` must be an integer (None would draw a random one) and
    ``size`` at least 1. An unknown dataset is left to ``make_rg_dataset``'s line."""
    rg = require_reasoning_gym()
    if dataset not in rg.factory.DATASETS:
        return
    _, config_cls = rg.factory.DATASETS[dataset]
    try:
        hints = typing.get_type_hints(config_cls)
    except (NameError, TypeError):  # an annotation that does not resolve: names and bounds only
        hints = {}
    fields = {name: hints.get(name) for name in getattr(config_cls, "__dataclass_fields__", {})}
    if not fields:  # not a dataclass: reasoning-gym's own checks only
        return
    if "seed" in fields:
        fields["seed"] = int
    check_options(f"rg:{dataset}", options, fields, {"size": (1, None)})

