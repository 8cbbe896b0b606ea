"""The options of ``grpolab eval``, ``compare`` and ``demo`` as validated configs, so that each rule
lives once: typer parses the command line, the command builds its options from what typer parsed
(``from_cli``), and the model validates them — with the field types of the training configs where an
option is the same thing (the dtype, the sampling temperature and lengths, the reward, the rollout
backend, the reward timeout, the count of held-out questions). A refusal is a ``ConfigError`` of one
line naming the flag (``--n must be at least 1, got 0``), which the command prints with exit code 2.

Each field's flag, default and docstring are its typer option's (``fields.typer_options``), read from
the snapshot ``fields.json`` at start-up: the commands import this module when they run, not at
start-up (it imports the training configs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from ..envs.build import RetrievalSettings
from ..training.config import BaseConfig, ConfigError, short_repr, yaml_value
from ..training.run_config import RunConfig
from ..training.sampled_run_config import SampledRunConfig


def same_as(config: type[BaseConfig], name: str) -> Any:
    """The type of ``config``'s field ``name`` with its rules (bounds, allowed values, validators),
    for an option that is the same thing under another name."""
    info = config.model_fields[name]
    return Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation


Dtype = Literal["float32", "bfloat16"]  # eval, compare, demo: a dtype given (auto is for training runs)
Backend = Literal["hf", "vllm"]  # eval and compare sample with the hf or the colocated vllm backend
Temperature = same_as(SampledRunConfig, "eval_temperature")
MaxTokens = same_as(SampledRunConfig, "sampling_max_tokens")
MinTokens = same_as(SampledRunConfig, "sampling_min_tokens")
Questions = same_as(SampledRunConfig, "eval_examples")
TopP = same_as(SampledRunConfig, "sampling_top_p")
RewardTimeout = same_as(SampledRunConfig, "reward_timeout_s")
Reward = same_as(RunConfig, "reward")
TopK = same_as(RetrievalSettings, "top_k")


def key_values(items: list[str], flag: str) -> dict:
    """``KEY=VALUE`` strings -> dict, values read as the training commands read a value of a field
    that is not text (``yaml_value``: 2 -> int, true -> bool, [1, 2] -> a list, text as typed)."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key.strip()] = yaml_value(raw)
    return out


RULES = {"greater_than_equal": "at least {ge}", "greater_than": "greater than {gt}", "less_than_equal": "at most {le}",
         "less_than": "less than {lt}", "literal_error": "{expected}"}


class CommandOptions(BaseConfig):
    """A command's options; ``flags`` names the flag of a field whose flag is not ``--field-name``."""

    model_config = ConfigDict(use_attribute_docstrings=True)
    flags: ClassVar[dict[str, str]] = {}

    @classmethod
    def flag(cls, name: str) -> str:
        return cls.flags.get(name, "--" + name.replace("_", "-"))

    @classmethod
    def from_cli(cls, values: dict[str, Any]):
        """The options from the command's parameters (by field name); a ``ConfigError`` of one line
        naming each refused flag and its rule."""
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError("; ".join(cls._refusal(err) for err in exc.errors())) from None

    @classmethod
    def _refusal(cls, err: dict) -> str:
        if not err["loc"] or err["type"] == "value_error":  # a validator's own message names its flag or key
            return err["msg"].removeprefix("Value error, ")
        flag, rule = cls.flag(str(err["loc"][0])), RULES.get(err["type"])
        if rule is None:
            return f"{flag}: {err['msg']} (got {short_repr(err.get('input'))})"
        ctx = {k: str(v).replace("'", "") for k, v in (err.get("ctx") or {}).items()}
        return f"{flag} must be {rule.format(**ctx)}, got {short_repr(err.get('input'))}"


class EvalOptions(CommandOptions):
    """``grpolab eval``: the model, the questions, how they are sampled and scored, where the report goes."""

    flags: ClassVar[dict[str, str]] = {"task_options": "--task-option", "reward_timeout_s": "--reward-timeout"}

    model: str
    """A Hugging Face model directory, a LoRA adapter directory, or embedded:tiny."""
    data: str
    """The questions: a JSONL file (GSM8K, MATH, plain, conversational), task:NAME (an embedded task) or
    rg:NAME (a reasoning-gym generator)."""
    prompt_template: str | None = None
    """r1_zero, compact, question_only, chat, chat_r1 or a file; not given: the one the model was trained with
    (a grpolab run's final/: its run's config.yaml), else the task's (task:NAME), else r1_zero; said in one line."""
    system_prompt: str | None = None
    """Chat templates: a system message (its text, or a file's path)."""
    reward: Reward = None
    """A reward name, 'pkg.mod:fn', or YAML: '{model: runs/rm/final}' (a reward model), a weighted list; not
    given: the task's verifier, else r1_zero."""
    k: int = Field(1, ge=1)
    """Samples per question (pass@k, maj@k, consistency); 1: CS336's zero-shot baseline."""
    n: Questions | None = None
    """Questions to evaluate, the first n; not given: every example of a data file (CS336's baseline: all of
    MATH validation), 200 of a generated task's test split (task:NAME, rg:NAME)."""
    temperature: Temperature = 1.0
    """The sampling temperature (0: greedy); 1.0 as CS336's baseline."""
    top_p: TopP = 1.0
    """Nucleus sampling's top-p (1: the whole distribution, as CS336's baseline)."""
    max_tokens: MaxTokens = 1024
    """New tokens per sample at most (CS336: 1024). On a CPU with a real model the defaults take hours over
    thousands of questions: try --n 20 --max-tokens 256."""
    min_tokens: MinTokens = 0
    """New tokens before a stop or eos may end a sample (at most --max-tokens)."""
    stop: list[str] = Field(default_factory=lambda: ["</answer>"])
    """A stop string, kept in the output (repeat for several); not given: </answer>; --stop '' alone: none."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: float32 with --backend hf, bfloat16 with --backend vllm (the engine's weights, as CS336's vLLM);
    float32, or bfloat16 (hf: autocast over fp32 weights, as in training; vllm: the engine's dtype)."""
    task_options: dict[str, Any] = Field(default_factory=dict)
    """A setting of the embedded or reasoning-gym task, KEY=VALUE (repeat for several), e.g. digits=2."""
    entropy: bool = True
    """Also report the mean token entropy (a second pass over every response)."""
    corpus: str | None = None
    """A text/JSONL file or hf:NAME to report the model's perplexity on."""
    out: Path = Path("runs/eval")
    """Where eval.json and generations.jsonl go (checked writable before anything is loaded)."""
    seed: int = 0
    """Seeds the task's questions and the sampling."""
    reward_timeout_s: RewardTimeout = 10.0
    """Seconds a reward may take per response before it scores 0 (0: no limit)."""
    backend: Backend = "hf"
    """The sampler: hf (the model itself) or vllm (a vLLM engine)."""
    env: Path | None = None
    """A YAML file of tool-environment keys (as a config's env:): multi-turn tool use."""
    rag_corpus: str | None = None
    """Retrieval-augmented prompts: the corpus (JSONL or a directory of .txt files) whose top passages fill
    the template's {context}."""
    rag_top_k: TopK = 1
    """Passages per question with --rag-corpus."""

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_yaml(cls, value: Any) -> Any:
        """A reward model or a weighted list, given as YAML text."""
        if isinstance(value, str) and value.lstrip().startswith(("{", "[")):
            return key_values([f"reward={value}"], "--reward")["reward"]
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        """Not given: </answer>; empty strings dropped (``--stop ''`` for none)."""
        return ["</answer>"] if value is None else [s for s in value if s]

    @field_validator("task_options", mode="before")
    @classmethod
    def _task_options(cls, value: Any) -> Any:
        """``KEY=VALUE`` strings (``--task-option``, repeated) into a mapping."""
        return key_values(list(value or []), "--task-option") if value is None or isinstance(value, (list, tuple)) \
            else value

    @model_validator(mode="after")
    def _check(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"--min-tokens must be within [0, --max-tokens ({self.max_tokens})], "
                             f"got {self.min_tokens}")
        if self.task_options and not self.data.startswith(("task:", "rg:")):
            raise ValueError("--task-option applies to a generated task (--data task:NAME or rg:NAME)")
        return self

    @property
    def retrieval(self) -> dict | None:
        """The ``retrieval`` mapping of a config (``RunConfig.retrieval``) for ``--rag-corpus``."""
        return {"corpus": self.rag_corpus, "top_k": self.rag_top_k} if self.rag_corpus is not None else None


class CompareOptions(CommandOptions):
    """``grpolab compare``: MLE vs PPO vs GRPO (and expert iteration) from one warm start, or GRPO variants."""

    run_dir: Path = Path("runs/compare")
    """Where report.md, report.json and report.png go."""
    seed: int = 0
    """The seed of the warm start and of every method's run."""
    steps: int | None = Field(None, ge=1)
    """The budget in RL steps of 128 responses; not given: 100 (60 with --variants; 4 of 32 with --variants
    --model)."""
    k: int = Field(4, ge=1)
    """Samples per held-out question."""
    test_examples: int | None = Field(None, ge=1)
    """Held-out questions; not given: 200 (50 with --model)."""
    ei: bool = False
    """Also run expert iteration."""
    warm_steps: int | None = None
    """The warm-start SFT length; not given: the study's own."""
    variants: str | None = None
    """GRPO variants side by side instead of the method comparison, e.g. grpo,dr_grpo,dapo,gspo,cispo,rloo."""
    seeds: int = Field(3, ge=1)
    """With --variants: seeds (warm starts) per variant."""
    model: str | None = None
    """With --variants: a local chat model directory instead of the embedded model (no warm start)."""
    data: str | None = None
    """With --variants: a reasoning-gym dataset (rg:NAME) instead of the arithmetic task (no warm start)."""
    backend: Backend = "hf"
    """The sampler of the held-out evaluations: hf or vllm."""
    env: Path | None = None
    """A YAML file of tool-environment keys: the evaluations sample through it, GRPO trains with it."""

    @model_validator(mode="after")
    def _check(self):
        if self.variants is not None and self.env is not None:
            raise ValueError("--env applies to the method comparison (MLE/PPO/GRPO), not to --variants")
        if self.variants is None and (self.model is not None or self.data is not None):
            raise ValueError("--model and --data apply to --variants (the method comparison's MLE needs the embedded "
                             "task's worked solutions)")
        return self


class DemoOptions(CommandOptions):
    """``grpolab demo``: SFT warm-up then GRPO on the embedded model (with tools: questions answered by search)."""

    run_dir: Path = Path("runs/demo")
    """Where the demo writes everything (the tool demo: runs/demo_tools unless given)."""
    seed: int = 0
    """The demo's one seed."""
    sft_steps: int | None = None
    """The SFT warm-up's length; not given: the demo's own."""
    grpo_steps: int | None = None
    """The number of GRPO steps; not given: the demo's own."""
    test_examples: int | None = None
    """Held-out questions to evaluate on; not given: the demo's own."""
    tools: bool = False
    """The tool-use demo: questions about invented entities, answered with a live BM25 search tool."""
    dtype: Dtype = "float32"
    """Training numerics: float32, or bfloat16 (autocast over fp32 weights)."""


# each command's options, by command (the snapshot's keys)
OPTIONS = {"eval": EvalOptions, "compare": CompareOptions, "demo": DemoOptions}
