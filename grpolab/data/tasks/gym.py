"""reasoning-gym tasks (``task: rg:NAME``): the field's procedural generators, nothing downloaded.

``task_options`` go to the generator's config (``size``, ``seed``, its difficulty fields, e.g.
``min_digits``); the item at index ``i`` of a generator is fixed by its seed. Splits never share an
item: items are drawn in index order and each is kept by the split its question hashes to
(``split_of``: 10 % test, 10 % validation, 80 % train; duplicates dropped), as for the embedded
tasks — so the first ``k`` items of a split are the same whatever ``n`` is asked for. The
generator's ``size`` bounds the indices drawn (default 100,000). reasoning-gym draws item ``i``
from ``Random(seed + i)``, so seeds 3 and 4 would give the same items shifted by one: the run's
``seed`` becomes the generator's seed ``seed * 1,000,003`` (streams that do not overlap), unless
``task_options`` gives ``seed`` itself, which is used as it is.

Rewards are the dataset's own ``score_answer`` (``grpolab.rewards.gym``), run in the supervised
reward workers like any non-built-in reward. There are no worked solutions (``solution`` is None):
SFT and DPO need another source of demonstrations.
"""

from __future__ import annotations

from ...rewards.gym import make_rg_dataset, rg_reward_fn, rg_whole_response_reward_fn
from ..datasets import Example
from .base import SPLITS, split_of

DEFAULT_SIZE = 100_000
SEED_STRIDE = 1_000_003  # > any size drawn from: the item streams of two run seeds never overlap


class ReasoningGymTask:
    """A reasoning-gym generator as a grpolab task: ``examples(split, n)`` like the embedded ones."""

    default_template = "r1_zero"
    reward_fn = staticmethod(rg_reward_fn)
    whole_response_reward_fn = staticmethod(rg_whole_response_reward_fn)  # chat templates without tags

    def __init__(self, dataset: str, seed: int = 0, **options):
        self.dataset = dataset
        self.name = f"rg:{dataset}"
        self.options = {"seed": seed * SEED_STRIDE, "size": DEFAULT_SIZE, **options}
        self.generator = make_rg_dataset(dataset, self.options)  # one line for a bad name or option

    def examples(self, split: str, n: int) -> list[Example]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        out, seen = [], set()
        size = len(self.generator)
        for index in range(size):
            if len(out) >= n:
                break
            entry = self.generator[index]
            question = entry["question"]
            if question in seen or split_of(question) != split:
                continue
            seen.add(question)
            truth = {"dataset": self.dataset, "options": self.options, "entry": _plain(entry)}
            out.append(Example(question, truth, None, {"split": split, "source": f"{self.name}:{split}:{len(out)}",
                                                       "rg_index": index}))
        if len(out) < n:
            raise ValueError(f"task {self.name!r} has fewer than {n} distinct {split} questions in its {size} items "
                             "(raise task_options.size, or ask for fewer)")
        return out


def _plain(value):
    """The entry as plain data (JSON types), so it can be sent to a worker and logged."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return value.item() if hasattr(value, "item") else str(value)  # numpy scalars; anything else as text
