"""Learned reward models as rewards: ``reward: {model: PATH}``, alone or in the weighted list.

A reward model is any local ``AutoModelForSequenceClassification`` directory (``grpolab rm``'s
``final/`` is one). It reads the prompt the policy saw followed by the response — or, with
``chat_template: true``, the question and the response as a user/assistant exchange rendered by
its own tokenizer's chat template — truncated from the left to ``max_length`` tokens (the end,
where the score is read, is kept), and its score is one logit: the only one, or the ``label``'s
(an index or an ``id2label`` name), as a logit or (``score: probability``) a probability.

Where it runs: in the trainer's process, in batches of ``batch_size``, on the trainer's device
(or ``device``), in ``dtype``, under ``torch.no_grad``. Not in the supervised reward workers:
those are CPU processes that score one item at a time under a memory cap (4 GB by default); a
model there would be loaded once per worker, could not use the GPU, and a batch of one forward per
response would waste it. A reward model is a trusted local forward pass, not user code: what the
workers guard against (hangs, ``os._exit``, segfaults in Python) is not its risk. A non-finite
score is still charged like a failing reward (component 0, counted in the scorer's errors).

Normalisation (``normalize``): ``none``; ``batch`` (z-score over the batch being scored — under
torchrun over every rank's shard together); ``running`` (z-score by a running mean and std of every
score so far, also over all ranks; its state is saved in the run's checkpoints). Evaluation and
validation score raw (``unnormalized``): they leave the running statistics alone.

When it is checked: the keys and that ``model`` is a sequence classifier (its ``config.json``) when the
config is built; the rest — the weights read whole, the head present, ``label`` within the labels, the
tokenizer and its chat template, ``device`` usable — when the trainers check their inputs
(``load_reward_models``), before a run directory is touched, ``--overwrite`` clears one or ``--resume``
cuts its metrics back; ``grpolab eval`` does the same before sampling. The models loaded there score.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

MODEL_KEYS = ("model", "weight", "name", "label", "score", "device", "dtype", "max_length", "chat_template",
              "normalize", "batch_size")


class RewardModelOptions(BaseModel):
    """One reward-model component of ``reward:`` (the keys of ``{model: PATH, ...}``)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    model: str
    weight: float = 1.0
    name: str | None = None  # logged as train/reward_<name>; default rm (rm#1, ... for several)
    label: int | str | None = None  # which logit: None = the only one; an index or an id2label name
    score: Literal["logit", "probability"] = "logit"
    device: str | None = None  # None: the trainer's device
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_length: int = Field(1024, ge=1)
    chat_template: bool = False  # render (question, response) with the reward model's own chat template
    normalize: Literal["none", "batch", "running"] = "none"
    batch_size: int = Field(32, ge=1)

    @field_validator("model")
    @classmethod
    def _directory(cls, value: str) -> str:
        """A sequence classifier's directory: a causal LM would score with a freshly initialised head."""
        from ..models.classifier import describe_architecture, is_sequence_classifier

        if not (Path(value).expanduser() / "config.json").is_file():
            raise ValueError(f"{value}: not a model directory (no config.json); a reward model is a local "
                             "AutoModelForSequenceClassification directory, e.g. grpolab rm's final/")
        if not is_sequence_classifier(value):
            raise ValueError(f"{value}: {describe_architecture(value)}; a reward model is a local "
                             "AutoModelForSequenceClassification directory with a trained head, e.g. grpolab rm's "
                             f"final/ (grpolab rm --model {value} trains one from it)")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str | None) -> str | None:
        """A device string torch reads (whether this machine has it is checked when the model loads)."""
        import torch

        if value is not None:
            try:
                kind = torch.device(value).type
            except (RuntimeError, ValueError):
                kind = None
            if kind not in ("cpu", "cuda", "mps"):  # meta, xla, ...: no scores come back from those
                raise ValueError(f"{value!r} is not a device a reward model runs on (cpu, cuda, cuda:N, mps)")
        return value


def is_model_component(value: Any) -> bool:
    return isinstance(value, dict) and "model" in value


def reward_model_text(tokenizer, prompt: Any, response: str, question: Any = None, chat_template: bool = False) -> str:
    """What a reward model reads: ``prompt + response``, or with ``chat_template`` the question and
    the response as a user/assistant exchange in the tokenizer's chat template. ``grpolab rm``
    trains on the same texts."""
    if not chat_template:
        if not isinstance(prompt, str):
            chat_template, question = True, prompt  # a conversational prompt needs a chat template
        else:
            return prompt + response
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("reward model: chat_template is set but its tokenizer has no chat template")
    question = prompt if question is None else question
    messages = list(question) if isinstance(question, (list, tuple)) else [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)


class RunningMeanStd:
    """Running mean and variance (Chan et al.'s parallel update), saved with the run."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    def update(self, n: float, mean: float, m2: float) -> None:
        if n <= 0:
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def _global_moments(values: list[float]) -> tuple[float, float, float]:
    """(n, mean, sum of squared deviations) of ``values`` over every rank (one process: its own)."""
    import torch.distributed as dist

    parts = [values]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, values)
    flat = [v for part in parts for v in part]
    n = len(flat)
    if not n:
        return 0.0, 0.0, 0.0
    mean = sum(flat) / n
    return float(n), mean, sum((v - mean) ** 2 for v in flat)


def reward_device(option: str | None, default=None):
    """Where a reward model runs: its ``device`` (which this machine must have), else ``default`` (the
    trainer's), else CUDA when there is one. A device the machine lacks is one line naming reward.device."""
    import torch

    if option is None:
        return torch.device(default or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = torch.device(option)
    if target.type == "cuda" and not torch.cuda.is_available():
        missing = f"this torch ({torch.__version__}) has no usable CUDA device"
    elif target.type == "cuda" and target.index is not None and target.index >= torch.cuda.device_count():
        missing = f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    elif target.type == "mps" and not torch.backends.mps.is_available():
        missing = "this machine has no MPS device"
    else:
        return target
    raise ValueError(f"reward.device {option!r}: {missing}; set it to cpu, or leave it out to run the reward model "
                     "on the trainer's device")


class RewardModel:
    """One reward model, loaded by ``load`` (the trainers' input check) or on first use; ``raw_scores`` and
    ``normalized`` (see the module doc)."""

    def __init__(self, options: RewardModelOptions):
        self.options = options
        self.running = RunningMeanStd()
        self.model = self.tokenizer = self.index = None

    def load(self, device=None) -> None:
        """Open the model on its device (see ``reward_device``): weights read whole, its head present (never a
        fresh one), ``label`` among its labels, the tokenizer with a chat template where ``chat_template`` asks
        for one; a one-line error otherwise. Once: a loaded model stays (and scores)."""
        if self.model is not None:
            return
        from ..models.classifier import load_sequence_classifier
        from ..models.loading import resolve_dtype

        o = self.options
        target = reward_device(o.device, device)
        model, tokenizer = load_sequence_classifier(o.model, dtype=resolve_dtype(o.dtype), require_head=True)
        self.index = self._label_index(model)
        if o.chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"reward model {o.model}: chat_template is set but its tokenizer has no chat template")
        tokenizer.truncation_side = "left"  # the score is read at the end: keep the response's end
        self.model, self.tokenizer = model.to(target).eval().requires_grad_(False), tokenizer

    def _label_index(self, model) -> int:
        labels, label = int(model.config.num_labels), self.options.label
        if label is None:
            if labels != 1:
                raise ValueError(f"reward model {self.options.model} has {labels} labels "
                                 f"({model.config.id2label}); choose one with label: INDEX or NAME")
            return 0
        if isinstance(label, int):
            if not 0 <= label < labels:
                raise ValueError(f"reward model {self.options.model}: label {label} out of range (it has {labels})")
            return label
        names = {str(v): int(k) for k, v in model.config.id2label.items()}
        if label not in names:
            raise ValueError(f"reward model {self.options.model}: no label {label!r}; its labels: {', '.join(names)}")
        return names[label]

    def raw_scores(self, prompts: Sequence[Any], responses: Sequence[str], questions: Sequence[Any] | None = None,
                   device=None) -> list[float]:
        import torch

        self.load(device)
        o, dev = self.options, next(self.model.parameters()).device
        questions = questions if questions is not None else [None] * len(prompts)
        texts = [reward_model_text(self.tokenizer, p, r, q, o.chat_template)
                 for p, r, q in zip(prompts, responses, questions)]
        out: list[float] = []
        with torch.no_grad():
            for i in range(0, len(texts), o.batch_size):
                enc = self.tokenizer(texts[i : i + o.batch_size], return_tensors="pt", padding=True, truncation=True,
                                     max_length=o.max_length, add_special_tokens=False).to(dev)
                logits = self.model(**enc).logits.float()
                if o.score == "logit":
                    values = logits[:, self.index]
                elif logits.shape[1] == 1:
                    values = torch.sigmoid(logits[:, 0])
                else:
                    values = torch.softmax(logits, dim=-1)[:, self.index]
                out.extend(values.cpu().tolist())
        return out

    def normalized(self, raw: list[float]) -> list[float]:
        """``raw`` under the chosen normalisation (non-finite values are left out of the statistics)."""
        if self.options.normalize == "none":
            return list(raw)
        n, mean, m2 = _global_moments([v for v in raw if math.isfinite(v)])
        if self.options.normalize == "batch":
            std = math.sqrt(m2 / n) if n > 1 else 1.0
        else:
            self.running.update(n, mean, m2)
            mean, std = self.running.mean, self.running.std
        return [(v - mean) / (std + 1e-6) for v in raw]


class ModelReward:
    """A reward with learned reward models: an optional rule part (a reward function, e.g. a
    ``WeightedReward`` of the list's rule components) plus ``weight x score`` of each model."""

    def __init__(self, rule, models: list[RewardModel]):
        self.rule, self.models = rule, models
        self.normalizing = True  # False inside ``unnormalized``
        self.names: list[str] = []
        for i, m in enumerate(models):
            base = m.options.name or "rm"
            self.names.append(base if base not in self.names else f"{base}#{i}")

    def load(self, device=None) -> None:
        """Open every model now (``RewardModel.load``)."""
        for rm in self.models:
            rm.load(device)

    def combine(self, rule_scores: list[dict], prompts, responses, questions=None, device=None
                ) -> tuple[list[dict], list[str]]:
        """Each item's scores with every model's component (``<name>``, and ``<name>_raw`` before
        normalisation) added to ``reward``; and the messages of non-finite model scores (charged 0).
        Inside ``unnormalized`` the component is the raw score and no statistics move."""
        out = [dict(s) for s in rule_scores]
        errors: list[str] = []
        for name, rm in zip(self.names, self.models):
            raw = rm.raw_scores(prompts, responses, questions, device)
            for s, r, v in zip(out, raw, rm.normalized(raw) if self.normalizing else list(raw)):
                if not math.isfinite(v):
                    errors.append(f"reward model {rm.options.model} gave a non-finite score ({r})")
                    v = 0.0
                s[name], s[f"{name}_raw"] = v, r if math.isfinite(r) else 0.0
                s["reward"] = s.get("reward", 0.0) + rm.options.weight * v
        return out, errors

    def state_dict(self) -> dict:
        return {name: rm.running.state_dict() for name, rm in zip(self.names, self.models)}

    def load_state_dict(self, state: dict) -> None:
        for name, rm in zip(self.names, self.models):
            if name in state:
                rm.running.load_state_dict(state[name])


def unnormalized(reward: Any):
    """A context in which a ``ModelReward`` (anything else: nothing changes) scores its models raw: their
    ``normalize`` is not applied and the running statistics do not move. Evaluation and validation score
    so: a z-score over the evaluated batch has mean 0 by construction, and validation rollouts (drawn with
    the eval sampling settings) must not shift the statistics that normalise training rewards."""
    if not isinstance(reward, ModelReward):
        return nullcontext(reward)
    return _unnormalized(reward)


@contextmanager
def _unnormalized(reward: ModelReward):
    before, reward.normalizing = reward.normalizing, False
    try:
        yield reward
    finally:
        reward.normalizing = before


def load_reward_models(*rewards: Any, device=None) -> None:
    """Open the reward models among ``rewards`` now, on ``device`` unless one names its own (see
    ``RewardModel.load``): the trainers call it in their input check, before the run directory is touched,
    ``grpolab eval`` before sampling. The loaded models are the ones that score (nothing loads twice)."""
    for reward in rewards:
        if isinstance(reward, ModelReward):
            reward.load(device)
