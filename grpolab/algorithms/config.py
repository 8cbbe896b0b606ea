"""Validated configs: YAML files plus command-line overrides; unknown keys and bad values are
one-line errors naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A bad config; the message names the file or key."""


def _format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(config)"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key '{key}'")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"'{key}': {msg} (got {err.get('input')!r})")
    return f"{source}: " + "; ".join(parts)


class BaseConfig(BaseModel):
    """Base of every method's config: no unknown keys, validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @classmethod
    def build(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None):
        """Load ``path`` (YAML), apply ``overrides`` (``key -> value``), validate."""
        data: dict[str, Any] = {}
        source = "config"
        if path is not None:
            source = str(path)
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"{path}: no such config file")
            try:
                loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f":{mark.line + 1}" if mark else ""
                raise ConfigError(f"{path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
            if loaded is None:
                loaded = {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: the config must be a mapping of keys to values")
            data.update(loaded)
        for key, value in (overrides or {}).items():
            key = key.replace("-", "_")
            if key not in cls.model_fields:
                raise ConfigError(f"unknown key '{key}' (command line); valid keys: {', '.join(cls.model_fields)}")
            data[key] = value
        try:
            return cls(**data)
        except ValidationError as exc:
            raise ConfigError(_format_validation_error(exc, source)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` pairs -> dict; values parsed as YAML scalars/lists."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: overrides are --key value")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key} needs a value")
            raw = args[i + 1]
            i += 2
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        out[key.replace("-", "_")] = raw if value is None and raw not in ("null", "~", "") else value
    return out


class RunConfig(BaseConfig):
    """The fields every training method shares: model, data, reward, optimizer basics, device, seed."""

    # --- model and data
    model: str = "embedded:tiny"  # a local HF directory, or embedded:tiny / embedded:small
    task: str | None = "arithmetic"  # an embedded task (arithmetic, countdown) ...
    task_options: dict[str, Any] = Field(default_factory=dict)  # ... its settings (digits, wrong_fraction, ...)
    task_train_size: int = Field(2000, ge=1)  # ... and how many distinct training questions to draw
    train_data: str | None = None  # or a file: GSM8K / MATH / plain JSONL (SFT: sft.jsonl; DPO: pairs), hf:NAME
    eval_data: str | None = None  # held-out questions (default: the task's validation split)
    data_format: Literal["auto", "gsm8k", "math", "jsonl"] = "auto"  # auto: by the file name
    question_field: str = "question"  # plain JSONL field names
    answer_field: str = "answer"
    data_on_error: Literal["raise", "skip"] = "raise"  # skip: malformed lines are skipped and counted
    prompt_template: str | None = None  # r1_zero | question_only | compact | a file; default: task's, else r1_zero
    reward: Any = None  # a reward name, "pkg.mod:fn", or weighted components; default: task's, else r1_zero
    # --- optimizer basics (AdamW as in CS336)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = 1.0
    # --- where and how
    device: str = "auto"
    seed: int = 0
    show_progress: bool = True

    @model_validator(mode="after")
    def _check_data(self):
        if (self.task is None) == (self.train_data is None):
            raise ValueError("give exactly one of task (an embedded task) and train_data (a file)")
        accumulation = getattr(self, "gradient_accumulation_steps", None)
        if accumulation and self.train_batch_size % accumulation:
            raise ValueError(
                f"train_batch_size ({self.train_batch_size}) must be divisible by gradient_accumulation_steps "
                f"({accumulation})")
        return self


class SampledRunConfig(RunConfig):
    """A run that samples from the policy (GRPO, SFT's validation, PPO, expert iteration): the
    sampling and validation fields, and the ``SamplingParams`` built from them."""

    sampling_temperature: float = Field(1.0, ge=0)
    sampling_top_p: float = Field(1.0, gt=0, le=1)
    sampling_min_tokens: int = Field(4, ge=0)  # as in CS336's expert iteration: no empty strings
    sampling_max_tokens: int = Field(1024, ge=1)
    stop: list[str] = Field(default_factory=lambda: ["</answer>"])  # kept in the output
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: autocast, fp32 weights and losses
    eval_examples: int = Field(200, ge=1)
    eval_temperature: float = Field(1.0, ge=0)  # CS336 evaluates by sampling at temperature 1

    @model_validator(mode="after")
    def _check_sampling(self):
        if self.sampling_min_tokens > self.sampling_max_tokens:
            raise ValueError(f"sampling_min_tokens ({self.sampling_min_tokens}) exceeds sampling_max_tokens "
                             f"({self.sampling_max_tokens})")
        return self

    def sampling_params(self):
        """Rollout sampling (no seed of its own: the trainer's generator carries the state)."""
        from ..rollout import SamplingParams

        return SamplingParams(temperature=self.sampling_temperature, top_p=self.sampling_top_p,
                              max_tokens=self.sampling_max_tokens, min_tokens=self.sampling_min_tokens,
                              stop=list(self.stop))

    def eval_sampling_params(self):
        """Validation sampling, seeded so every evaluation of a run sees the same draws."""
        from ..rollout import SamplingParams

        return SamplingParams(temperature=self.eval_temperature, max_tokens=self.sampling_max_tokens,
                              min_tokens=self.sampling_min_tokens, stop=list(self.stop), seed=self.seed + 1)
