"""Validated configs: YAML files plus command-line overrides; unknown keys and bad values are
one-line errors naming the key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..envs import check_env_options, check_retrieval_options
from ..rewards import check_reward_spec

# Mappings checked key by key when the config is built (an unknown key is a config error naming the
# field, not a TypeError deep in the run): a tool environment (envs.build_env's keys), and the
# corpus of retrieval-augmented prompts (envs.RETRIEVAL_KEYS).
EnvOptions = Annotated[dict[str, Any] | None, AfterValidator(lambda v: None if v is None else check_env_options(v))]
RetrievalOptions = Annotated[dict[str, Any] | None,
                             AfterValidator(lambda v: None if v is None else check_retrieval_options(v))]


class ConfigError(ValueError):
    """A bad config; the message names the file or key."""


def _format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key '{key}'")
        elif not key:  # a rule across fields: its message names them
            parts.append(msg)
        else:
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
            if value is BARE_FLAG:
                if cls.model_fields[key].annotation not in (bool, bool | None):
                    raise ConfigError(f"--{key.replace('_', '-')} needs a value")
                value = True
            data[key] = value
        try:
            return cls(**data)
        except ValidationError as exc:
            raise ConfigError(_format_validation_error(exc, source)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class _BareFlag:
    """A ``--key`` given without a value: ``true`` for a boolean field, an error for any other."""

    def __repr__(self) -> str:
        return "BARE_FLAG"


BARE_FLAG = _BareFlag()


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` pairs -> dict; values parsed as YAML scalars/lists. A
    bare ``--key`` (at the end, or followed by another ``--option``) means ``true``, so every
    boolean takes ``--flag``, ``--flag true`` and ``--flag false`` alike."""
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
        elif i + 1 >= len(args) or args[i + 1].startswith("--"):
            out[key.replace("-", "_")] = BARE_FLAG  # true for a boolean field; any other needs a value
            i += 1
            continue
        else:
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
    # r1_zero | question_only | compact | rag_compact | chat | chat_r1 | a file (read verbatim). Default: the
    # tokenizer's chat template where it has one (chat_r1 for a reward that reads <answer> tags, else chat),
    # else the task's own, else r1_zero
    prompt_template: str | None = None
    system_prompt: str | None = None  # chat templates: a system message (text, or a file's path)
    # retrieval-augmented prompts: a template's {context} gets the top BM25 passages for each question,
    # e.g. {corpus: corpus.jsonl, top_k: 2, max_chars: 200, cache_dir: runs/bm25, text_field: text}
    retrieval: RetrievalOptions = None
    # a reward name, "pkg.mod:fn", or weighted components; default: task's, else r1_zero
    reward: Annotated[Any, AfterValidator(lambda v: v if v is None else check_reward_spec(v))] = None
    # --- optimizer basics (AdamW as in CS336)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = 1.0
    # --- where and how
    device: str = "auto"
    # CPU: torch threads. None: OMP_NUM_THREADS when set, else a short probe keeps 1 or all cores, whichever
    # runs faster now (algorithms/resources.choose_cpu_threads; all cores collapse when other processes hold some)
    threads: int | None = Field(None, ge=1)
    seed: int = 0
    show_progress: bool = True
    deterministic: bool = False
    disable_dropout: bool = True  # dropout off in every forward (TRL's convention): ratios and KLs stay exact
    trust_remote_code: bool = False  # let a model directory run its own Python code (opt-in)
    # --- the run directory: validation, checkpoints, metrics
    run_dir: str = "runs/run"
    eval_every: int = Field(0, ge=0)  # outer steps between validations (0: only at the end)
    checkpoint_every: int = Field(0, ge=0)  # outer steps between checkpoints (0: only the final model)
    keep_last: int = Field(2, ge=1)
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    # --- scale (README "Scaling up"): under torchrun, each process one rank of a data-parallel run
    distributed: Literal["none", "ddp", "fsdp2", "deepspeed"] = "none"  # none: one process, no process group
    deepspeed_config: str | None = None  # a ZeRO-2/3 JSON (configs/deepspeed_zero3.json); default ZeRO-3
    fsdp_cpu_offload: bool = False  # FSDP2: parameters, gradients and optimizer state on the CPU
    gradient_checkpointing: bool = False  # recompute activations in the backward (less memory, ~30 % slower)
    lora_r: int = Field(0, ge=0)  # LoRA rank via peft (0 = off: full fine-tuning)
    lora_alpha: float = Field(16.0, gt=0)  # the adapter's scale is lora_alpha / lora_r
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] | str = "all-linear"  # peft names, or every linear layer but the head
    lora_save_merged: bool = False  # final/ holds the merged model (adapter in final/adapter/) instead of the adapter

    command: ClassVar[str] = "train"  # the CLI command that runs this config (for messages)
    steps_field: ClassVar[str] = "n_steps"  # the field holding the run's length in outer steps
    step_key: ClassVar[str] = "step"  # the outer step's name in metrics.jsonl

    @property
    def total_steps(self) -> int:
        return int(getattr(self, self.steps_field))

    @model_validator(mode="before")
    @classmethod
    def _train_data_means_no_task(cls, data: Any) -> Any:
        """``train_data`` given and ``task`` not: no embedded task (``task`` defaults to arithmetic
        only for a config that names no data at all)."""
        if isinstance(data, dict) and data.get("train_data") is not None and "task" not in data:
            return {**data, "task": None}
        return data

    @model_validator(mode="after")
    def _check_data(self):
        if (self.task is None) == (self.train_data is None):
            raise ValueError("give exactly one of task (an embedded task) and train_data (a file)")
        self._check_scale()
        accumulation = getattr(self, "gradient_accumulation_steps", None)
        if accumulation and self.train_batch_size % accumulation:
            raise ValueError(
                f"train_batch_size ({self.train_batch_size}) must be divisible by gradient_accumulation_steps "
                f"({accumulation})")
        return self


    def _check_scale(self) -> None:
        """Combinations of the scale fields that cannot work, refused before anything runs."""
        if self.deepspeed_config is not None and self.distributed != "deepspeed":
            raise ValueError(
                f"deepspeed_config is set but distributed is {self.distributed!r}; set distributed: deepspeed"
            )
        if self.fsdp_cpu_offload and self.distributed != "fsdp2":
            raise ValueError(f"fsdp_cpu_offload needs distributed: fsdp2 (got {self.distributed!r})")
        if self.lora_r and self.distributed == "deepspeed":
            raise ValueError(
                "lora_r with distributed: deepspeed is not supported; use ddp or fsdp2 (LoRA needs no ZeRO)"
            )
        if self.lora_dropout and self.disable_dropout:
            raise ValueError(
                f"lora_dropout ({self.lora_dropout}) has no effect while disable_dropout is true (dropout is "
                "off in every forward); set disable_dropout: false to use it"
            )
        if getattr(self, "rollout_backend", "hf") == "vllm" and self.distributed != "none" \
                and self.vllm_tensor_parallel_size > 1:
            raise ValueError(f"vllm_tensor_parallel_size ({self.vllm_tensor_parallel_size}) with distributed: "
                             f"{self.distributed}: each rank runs its own engine on its own device (tensor-parallel 1) "
                             "and samples its share of the prompts; set vllm_tensor_parallel_size: 1")
        if self.lora_save_merged and not self.lora_r:
            raise ValueError("lora_save_merged needs lora_r > 0")


class SampledRunConfig(RunConfig):
    """A run that samples from the policy (GRPO, SFT's validation, PPO, expert iteration): the
    sampling and validation fields, and the ``SamplingParams`` built from them."""

    sampling_temperature: float = Field(1.0, ge=0)
    sampling_top_p: float = Field(1.0, gt=0, le=1)
    sampling_min_tokens: int = Field(4, ge=0)  # as in CS336's expert iteration: no empty strings
    sampling_max_tokens: int = Field(1024, ge=1)
    stop: list[str] = Field(default_factory=lambda: ["</answer>"])  # kept in the output
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: autocast, fp32 weights and losses
    logits_fp32: bool = False  # under bfloat16: the lm_head and log-softmax in fp32 (sampler and trainer alike)
    eval_examples: int = Field(200, ge=1)
    eval_temperature: float = Field(1.0, ge=0)  # CS336 evaluates by sampling at temperature 1
    log_generations_samples: int = Field(8, ge=0)
    # --- rewards run guarded: a timeout, an exception or a NaN scores 0 and is counted
    reward_timeout_s: float = Field(10.0, ge=0)
    reward_workers: int = Field(0, ge=0)
    rollout_max_batch_size: int = Field(256, ge=1)  # rows sampled at once, whatever group_size is
    # --- the generation backend: hf (the training model itself) or vllm (a colocated vLLM engine in
    # this process, TRL's colocate mode: its own copy of the weights, synced in place after each update)
    rollout_backend: Literal["hf", "vllm"] = "hf"
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)  # GPU share for vLLM's weights + KV cache
    vllm_max_model_len: int | None = Field(None, ge=1)  # default: the model's max_position_embeddings
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    vllm_enable_sleep_mode: bool = False  # GPU: free vLLM's KV cache (and offload its weights) during the update
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: as the training dtype
    vllm_cpu_kvcache_space_gib: int = Field(1, ge=1)  # CPU KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB)
    vllm_enforce_eager: bool | None = None  # None: eager on the CPU (no compile wait), CUDA graphs on a GPU

    samples_with_vllm: ClassVar[bool] = False  # the trainer syncs a vLLM engine after its updates (GRPO)

    @model_validator(mode="after")
    def _check_sampling(self):
        if self.rollout_backend == "vllm" and not self.samples_with_vllm:
            raise ValueError(f"rollout_backend 'vllm' is supported by grpo and grpolab eval; {self.command} samples "
                             "with the training model: use rollout_backend 'hf'")
        if self.sampling_min_tokens > self.sampling_max_tokens:
            raise ValueError(f"sampling_min_tokens ({self.sampling_min_tokens}) exceeds sampling_max_tokens "
                             f"({self.sampling_max_tokens})")
        if self.sampling_temperature == 0 and getattr(self, "group_size", 1) > 1:
            raise ValueError(f"sampling_temperature 0 (greedy) with group_size {self.group_size}: every response of a "
                             "group would be identical, so every advantage is 0; sample at a temperature > 0 "
                             "(greedy is fine for evaluation: eval_temperature 0)")
        return self

    @property
    def policy_temperature(self) -> float:
        """The temperature of the policy being optimised: log-probs are of softmax(logits / T), the
        distribution the sampler draws from (TRL/veRL). Greedy sampling (T = 0) scores at T = 1."""
        return self.sampling_temperature or 1.0

    def backend_options(self) -> dict:
        """Keywords for ``rollout.make_backend`` beyond the model: the vLLM knobs for ``vllm``."""
        if self.rollout_backend != "vllm":
            return {}
        return dict(gpu_memory_utilization=self.vllm_gpu_memory_utilization, max_model_len=self.vllm_max_model_len,
                    tensor_parallel_size=self.vllm_tensor_parallel_size,
                    enable_sleep_mode=self.vllm_enable_sleep_mode,
                    dtype=self.dtype if self.vllm_dtype == "auto" else self.vllm_dtype,
                    cpu_kvcache_space_gib=self.vllm_cpu_kvcache_space_gib, enforce_eager=self.vllm_enforce_eager,
                    seed=self.seed)

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


# Fields that may change when a run is resumed besides its length (each config's ``steps_field``):
# how it is watched. Everything else is the run's own config, and changing it on resume would
# silently continue a different run.
RESUME_MAY_CHANGE = (
    "eval_every", "eval_examples", "checkpoint_every", "keep_last", "report_to", "show_progress",
    "log_generations_samples", "run_dir", "device", "token_record_groups", "threads",
)


@dataclass
class ResumeChanges:
    allowed: dict[str, tuple[Any, Any]]
    refused_fields: dict[str, tuple[Any, Any]]
    allowed_keys: tuple[str, ...]

    @property
    def refused(self) -> str:
        """A one-line diff of the refused changes (empty when none): ``key: old -> new; ...``."""
        return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in self.refused_fields.items())


def resume_changes(saved: dict[str, Any], new: dict[str, Any], steps_field: str) -> ResumeChanges:
    """Which fields differ between a run's saved config and the one it is resumed with; the run's
    length (``steps_field``) and the fields of ``RESUME_MAY_CHANGE`` may."""
    may_change = (steps_field, *RESUME_MAY_CHANGE)
    allowed, refused = {}, {}
    for key in sorted(saved):  # a field the saved run did not have (a newer grpolab) cannot have changed
        old, value = saved.get(key), new.get(key)
        if old != value and not (isinstance(old, (list, tuple)) and list(old) == list(value or [])):
            (allowed if key in may_change else refused)[key] = (old, value)
    return ResumeChanges(allowed, refused, may_change)


class PolicyUpdateConfig(SampledRunConfig):
    """What GRPO and PPO share: rollout and optimizer batches, the clipped update, the KL to a frozen
    reference with its controller, and the KL early stop. The defaults are CS336's GRPO ones; a
    method with other defaults lists them in ``method_defaults`` (applied where a value is not given)."""

    method_defaults: ClassVar[dict[str, Any]] = {}

    rollout_batch_size: int = Field(256, ge=1)
    group_size: int = Field(8, ge=1)  # responses per question
    train_batch_size: int = Field(256, ge=1)  # optimizer batch; < rollout_batch_size is off-policy
    gradient_accumulation_steps: int = Field(128, ge=1)  # micro-batch = train_batch_size / this
    learning_rate: float = Field(1e-5, gt=0)
    cliprange: float = Field(0.2, gt=0)
    whiten_advantages: bool = False
    warmup_steps: int = Field(1000, ge=0)  # linear warm-up (seed design), capped at 10 % of the optimizer steps
    lr_schedule: Literal["constant", "cosine"] = "constant"
    # KL to a frozen reference. kl_coef 0 means no KL anywhere: no reference model is loaded and the
    # adaptive controller stays off. Otherwise kl_adaptive moves the coefficient toward kl_target
    # (Ziegler et al.), within [kl_coef_min, kl_coef_max].
    kl_coef: float = Field(0.0, ge=0)
    kl_adaptive: bool = False
    kl_target: float = Field(0.1, gt=0)
    kl_horizon: int = Field(10000, ge=1)
    kl_coef_min: float = Field(0.1, ge=0)
    kl_coef_max: float = Field(0.3, ge=0)
    # KL early stop: before each optimizer step the approx KL(old || current) of its batch is
    # measured; if it exceeds kl_stop, that step is not applied and the rollout batch's remaining
    # updates are skipped (as Stable-Baselines3 and OpenAI's PPO do).
    kl_stop: float | None = Field(0.3, gt=0)
    # per-token records of this many sampled groups per step in tokens.jsonl, for grpolab view (0: none)
    token_record_groups: int = Field(2, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _method_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.method_defaults:
            return {**cls.method_defaults, **data}
        return data

    @model_validator(mode="after")
    def _check_batches(self):
        if self.rollout_batch_size % self.group_size:
            raise ValueError(
                f"rollout_batch_size ({self.rollout_batch_size}) must be divisible by group_size ({self.group_size})"
            )
        if self.rollout_batch_size % self.train_batch_size:
            raise ValueError(
                f"rollout_batch_size ({self.rollout_batch_size}) must be divisible by train_batch_size "
                f"({self.train_batch_size})"
            )
        if self.kl_coef_min > self.kl_coef_max:
            raise ValueError(f"kl_coef_min ({self.kl_coef_min}) exceeds kl_coef_max ({self.kl_coef_max})")
        return self

    def kl_controller(self):
        """The KL coefficient's controller: fixed (0 when kl_coef is 0), or adaptive."""
        from ..core import AdaptiveKLController, FixedKLController

        if self.kl_adaptive and self.kl_coef > 0:
            return AdaptiveKLController(
                self.kl_coef, self.kl_target, self.kl_horizon, self.kl_coef_min, self.kl_coef_max
            )
        return FixedKLController(self.kl_coef)
