"""``RunConfig``: the fields every training method shares (model, data, reward, optimizer basics,
device, seed, run directory, scale), each documented by the docstring under it."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from ..envs import check_env_options, check_retrieval_options
from ..rewards import check_reward_spec
from .config import BaseConfig

# Mappings checked key by key when the config is built (an unknown key is a config error naming the
# field, not a TypeError deep in the run): a tool environment (envs.build_env's keys), and the
# corpus of retrieval-augmented prompts (envs.RETRIEVAL_KEYS).
EnvOptions = Annotated[dict[str, Any] | None, AfterValidator(lambda v: None if v is None else check_env_options(v))]
RetrievalOptions = Annotated[dict[str, Any] | None,
                             AfterValidator(lambda v: None if v is None else check_retrieval_options(v))]
Beta = Annotated[float, Field(ge=0, lt=1)]  # an AdamW moment's decay


def _device(value: str) -> str:
    """``auto`` or a torch device of a kind the trainers run on (cpu, cuda, cuda:N, mps)."""
    import torch

    if value == "auto":
        return value
    try:
        kind = torch.device(value).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{value!r} is not a device the trainers run on (auto, cpu, cuda, cuda:N, mps)")
    return value


def _named(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


def _names_verifiers(env: Any) -> bool:
    """A config's ``env`` names a verifiers environment (``env: {verifiers: NAME}``)."""
    return isinstance(env, dict) and bool(env.get("verifiers"))


class RunConfig(BaseConfig):
    """The fields every training method shares: model, data, reward, optimizer basics, device, seed."""

    # --- Model and data
    model: Annotated[str, AfterValidator(_named)] = "embedded:tiny"
    """The model to train: a local Hugging Face directory (safetensors; a run's final/, a LoRA adapter), or
    embedded:tiny (~0.9M parameters) / embedded:small (~9.5M), built in-process with a character tokenizer."""
    task: str | None = "arithmetic"
    """An embedded task to draw questions from: arithmetic, countdown, retrieval, or rg:NAME (a reasoning-gym
    generator); null with train_data. Give exactly one of task and train_data."""
    task_options: dict[str, Any] = Field(default_factory=dict)
    """The task's own settings, e.g. {digits: 2, num_ops: 2} for arithmetic, a reasoning-gym generator's
    config fields for rg:NAME."""
    task_train_size: int = Field(2000, ge=1)
    """How many distinct training questions (DPO, RM: preference pairs) to draw from the task."""
    train_data: str | None = None
    """Training data from a file instead of a task: GSM8K / MATH / plain JSONL (SFT: sft.jsonl pairs; DPO, RM:
    {prompt, chosen, rejected}), or hf:NAME (a Hugging Face dataset, the datasets extra)."""
    eval_data: str | None = None
    """Held-out questions (DPO, RM: pairs) for validation. Null: with task, the task's validation split; with
    train_data, GRPO, SFT, EI and PPO validate on nothing (no eval/* figures), DPO and RM hold out a seeded 10 %
    of its pairs."""
    data_format: Literal["auto", "gsm8k", "math", "jsonl"] = "auto"
    """How to read train_data/eval_data; auto: by the file name (gsm8k in it: GSM8K, math: MATH, else JSONL)."""
    question_field: str = "question"
    """Plain JSONL: the key holding each question."""
    answer_field: str | None = "answer"
    """Plain JSONL: the key holding each ground-truth answer; null: a prompt-only file (grpolab distill)."""
    data_on_error: Literal["raise", "skip"] = "raise"
    """A malformed line, or a prompt too long for the model's context: raise (one-line error), or skip it
    (counted and reported)."""
    prompt_template: str | None = None
    """r1_zero | question_only | compact | rag_compact | chat | chat_r1 | a file (read verbatim). Null: the
    tokenizer's chat template where it has one (chat_r1 for a reward reading <answer> tags, else chat), else
    the task's own, else r1_zero (CS336)."""
    system_prompt: str | None = None
    """Chat templates: a system message (its text, or a file's path: a value that looks like a path but
    is no readable file is refused), put first in every prompt and conversation that has none of its
    own (SFT and DPO data files too); null: none."""
    retrieval: RetrievalOptions = None
    """Retrieval-augmented prompts: a template's {context} gets the top BM25 passages of a corpus for each
    question, e.g. {corpus: corpus.jsonl, top_k: 2, max_chars: 200, cache_dir: runs/bm25, text_field: text}."""
    reward: Annotated[Any, AfterValidator(lambda v: v if v is None else check_reward_spec(v))] = None
    """The reward: a built-in verifier's name (r1_zero, gsm8k, countdown, ...), "pkg.mod:fn", a reward
    model {model: DIR}, or a list of weighted components; null: the task's verifier, else r1_zero."""
    # --- Optimizer (AdamW, as in CS336)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    """AdamW's (beta1, beta2), CS336's defaults."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay (CS336: 0)."""
    max_grad_norm: float | None = Field(1.0, ge=0)
    """Clip the gradient's global L2 norm to this before each optimizer step; null or 0: no clipping."""
    # --- Device and reproducibility
    device: Annotated[str, AfterValidator(_device)] = "auto"
    """A torch device (cpu, cuda, cuda:1, ...); auto: cuda when available, else cpu. Under torchrun each rank
    takes its own GPU."""
    threads: int | None = Field(None, ge=1)
    """CPU: torch threads. Null: OMP_NUM_THREADS when set, else a short probe keeps 1 or all cores, whichever
    runs faster now (all cores collapse when other processes hold some)."""
    keep_freed_memory: bool = True
    """CPU, glibc (Linux): freed blocks stay in the heap for reuse, not handed back for the kernel to re-zero on
    next touch (SmolLM2's GRPO update 9.5-10.0 -> 8.9 s on 2 cores), for the process's life; false: glibc's defaults."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seeds Python, torch and numpy, the model's initialisation (embedded models), question order and sampling."""
    show_progress: bool = True
    """A progress bar over the outer steps (rank 0)."""
    deterministic: bool = False
    """Deterministic torch kernels where torch has them (warn otherwise) and no CPU thread probe: reruns agree."""
    disable_dropout: bool = True
    """Dropout off in every forward (TRL's convention), so ratios and KLs compare one distribution."""
    trust_remote_code: bool = False
    """Let a model directory run its own Python code (auto_map in config.json); opt-in."""
    # --- Run directory: validation, checkpoints, metrics
    run_dir: str = "runs/run"
    """Where the run writes config.yaml, metrics.jsonl, samples/, checkpoints/ and final/ (each method has its
    own default); a directory holding another run is refused without --overwrite."""

    @field_validator("run_dir")
    @classmethod
    def _run_dir_named(cls, value: str) -> str:  # each method's own default keeps the rule
        return _named(value)
    eval_every: int = Field(0, ge=0)
    """Outer steps between periodic validations (0: none; the run still validates at its end)."""
    checkpoint_every: int = Field(0, ge=0)
    """Outer steps between checkpoints, from which --resume continues (0: none, but Ctrl-C still writes one; the
    final model is always saved)."""
    keep_last: int = Field(2, ge=1)
    """How many of the newest checkpoints are kept."""
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(default_factory=list)
    """Also send the metrics to TensorBoard, Weights & Biases and/or trackio (the track extra; metrics.jsonl always):
    train/* against train_step, eval/* against eval_step. One name is a list of one (--report-to wandb)."""
    tracker_project: str | None = None
    """W&B / trackio project; null: WANDB_PROJECT, else grpolab."""
    tracker_entity: str | None = None
    """W&B entity (team or user); null: WANDB_ENTITY, else the account's default."""
    tracker_run_name: str | None = None
    """W&B / trackio run name; null: WANDB_NAME, else the run directory's name."""
    # --- Scale: torchrun (DDP, FSDP2, ZeRO), LoRA
    distributed: Literal["none", "ddp", "fsdp2", "deepspeed"] = "none"
    """Under torchrun, each process is one rank of a data-parallel run: ddp, fsdp2 (sharded) or deepspeed
    (ZeRO-2/3); none: one process, no process group."""
    deepspeed_config: str | None = None
    """distributed: deepspeed: a ZeRO-2/3 JSON file (configs/deepspeed_zero3.json); null: ZeRO-3."""
    fsdp_cpu_offload: bool = False
    """FSDP2: keep parameters, gradients and optimizer state on the CPU (less GPU memory, slower)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward: less memory, ~30 % slower."""
    compile: Literal["auto", "true", "false"] = "auto"
    """torch.compile (inductor) of the decoder layers in the trainer's forwards, one graph for all lengths; the
    first update pays the compile, GRPO forgoes share_prompt_prefix. auto: CUDA without prompt sharing
    (docs/results/compile.md)."""
    lora_r: int = Field(0, ge=0)
    """LoRA rank via peft (the scale extra); 0: off, full fine-tuning."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA's alpha: the adapter's scale is lora_alpha / lora_r."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input; needs disable_dropout: false to act."""
    lora_target_modules: list[str] | str = "all-linear"
    """The layers that get adapters: peft module names, or all-linear (every linear layer but the head)."""
    lora_save_merged: bool = False
    """final/ holds the merged model (the adapter in final/adapter/) instead of the adapter alone."""

    command: ClassVar[str] = "train"  # the CLI command that runs this config (for messages)
    steps_field: ClassVar[str] = "n_steps"  # the field holding the run's length in outer steps
    step_key: ClassVar[str] = "step"  # the outer step's name in metrics.jsonl
    # What the method's trainer does that the shared machinery must know (run_model.check_distributed,
    # memory_plan); the defaults are the common case, a method's config sets the ones that differ.
    # A value head trained beside the policy, outside the engine's wrapping: refused under distributed.
    trains_value_head: ClassVar[bool] = False
    # Each group of group_size responses stays on one rank (the group is the advantage's baseline).
    groups_on_one_rank: ClassVar[bool] = False
    # The update splits a rank's rows into micro-batches of unequal sizes (its loss normalisers are the
    # whole optimizer batch's), so train_batch_size need not split into equal micro-batches on each rank.
    uneven_micro_batches: ClassVar[bool] = False
    # A frozen reference policy is loaded whatever kl_coef is (the method's loss reads it).
    needs_reference: ClassVar[bool] = False
    # The sequences one training example puts through the model.
    rows_per_example: ClassVar[int] = 1

    @property
    def total_steps(self) -> int:
        return int(getattr(self, self.steps_field))

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_words(cls, value: Any) -> Any:  # YAML's true/false arrive as booleans
        return str(value).lower() if isinstance(value, bool) else value

    @model_validator(mode="before")
    @classmethod
    def _train_data_means_no_task(cls, data: Any) -> Any:
        """``train_data`` or ``env.verifiers`` given and ``task`` not: no embedded task (``task``
        defaults to arithmetic only for a config that names no data at all)."""
        if isinstance(data, dict) and "task" not in data and (data.get("train_data") is not None
                                                              or _names_verifiers(data.get("env"))):
            return {**data, "task": None}
        return data

    @model_validator(mode="after")
    def _check_data(self):
        if _names_verifiers(getattr(self, "env", None)):
            if self.task is not None or self.train_data is not None:
                given = "task" if self.task is not None else "train_data"
                raise ValueError(f"env.verifiers is the run's data (its environment's dataset): give no {given} "
                                 "with it")
        elif (self.task is None) == (self.train_data is None):
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
