"""The configs of methods that sample from the policy: ``SampledRunConfig`` (sampling, validation,
guarded rewards, the generation backend) and ``PolicyUpdateConfig`` (what GRPO and PPO share: batches,
the clipped update, the KL to a reference), each field documented by the docstring under it."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from ..core import AdaptiveKLController, FixedKLController
from ..rollout import SamplingParams
from .run_config import RunConfig


class SampledRunConfig(RunConfig):
    """A run that samples from the policy (GRPO, SFT's validation, PPO, expert iteration): the
    sampling and validation fields, and the ``SamplingParams`` built from them."""

    # --- Sampling and validation
    sampling_temperature: float = Field(1.0, ge=0)
    """Rollout temperature T; the policy optimised is softmax(logits / T), so every trainer log-prob uses it.
    0 (greedy) is refused for training with group_size > 1."""
    sampling_top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1: all)."""
    sampling_min_tokens: int = Field(4, ge=0)
    """No end (eos, a stop) before this many response tokens; 4 as in CS336's expert iteration: no empty strings."""
    sampling_max_tokens: int = Field(1024, ge=1)
    """The most tokens a response may have (longer ones are cut: finish reason length)."""
    stop: list[str] = Field(default_factory=lambda: ["</answer>"])
    """Strings that end a response (matched on the decoded text, kept in the output)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """bfloat16: autocast in sampler and trainer (weights, losses fp32). auto: bf16 on a GPU, or on a CPU
    with AMX/AVX-512 BF16 where a short probe finds it faster (and >=30M parameters); else fp32."""
    logits_fp32: bool = False
    """Under bfloat16: the lm_head and log-softmax in fp32, in the sampler and the trainer alike (a smaller
    sampler/trainer log-prob gap)."""
    eval_examples: int = Field(200, ge=1)
    """The most validation questions each validation samples (from eval_data, or the task's validation split)."""
    eval_temperature: float = Field(1.0, ge=0)
    """Validation's sampling temperature (CS336 evaluates by sampling at 1; 0: greedy)."""
    log_generations_samples: int = Field(8, ge=0)
    """Validation responses written to samples/eval_step_N.jsonl each validation (CS336's log_generations)."""
    # --- Rewards (guarded: a timeout, an exception or a NaN scores 0, counted)
    reward_timeout_s: float = Field(10.0, ge=0)
    """Seconds a reward may take per response before it scores 0 and is counted as an error (0: no limit)."""
    reward_workers: int = Field(0, ge=0)
    """Worker processes that score rewards in parallel; 0: the built-in verifiers run in this process (a custom
    reward still runs in a supervised worker)."""
    # --- Generation backend: hf or vllm
    rollout_max_batch_size: int = Field(256, ge=1)
    """Rows sampled at once, whatever group_size is: lower it when sampling runs out of memory."""
    rollout_backend: Literal["hf", "vllm", "vllm_server"] = "hf"
    """hf: the training model samples (max_staleness >= 1: a sampler process); vllm: a vLLM engine in this process;
    vllm_server: a `vllm serve` process (vLLM's weight transfer). grpo, ei, sft's validation."""
    vllm_server_url: str | None = None
    """vllm_server: the base URL of a running `vllm serve` (e.g. http://127.0.0.1:8000) started with grpolab's
    weight-transfer engine; null: the run starts one on a free local port and stops it at the end."""
    vllm_server_timeout_s: float = Field(300.0, gt=0)
    """vllm_server: seconds to wait for the server to start and for one request; past it the run stops with one
    line (resumable from its last checkpoint)."""
    vllm_device: str | None = None
    """The device of the vLLM server the run starts itself (cpu, cuda:N; null: the policy's device). CS336's two
    GPUs: device cuda:0, vllm_device cuda:1, rollout_backend vllm_server (weights move by NCCL)."""
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """vLLM: the share of GPU memory for its weights and KV cache."""
    vllm_max_model_len: int | None = Field(None, ge=1)
    """vLLM: the longest prompt + response in tokens; null: the model's max_position_embeddings."""
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    """vLLM: GPUs one engine spans (1 under torchrun: each rank runs its own engine)."""
    vllm_enable_sleep_mode: bool = False
    """vLLM on a GPU: free the KV cache (and offload the engine's weights) during the update."""
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vLLM: the engine's dtype; auto: the training dtype."""
    vllm_cpu_kvcache_space_gib: int = Field(1, ge=1)
    """vLLM on the CPU: the KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE)."""
    vllm_enforce_eager: bool | None = None
    """vLLM: eager mode (no CUDA graphs); null: eager on the CPU (no compile wait), CUDA graphs on a GPU."""

    # the method's trainer syncs a vLLM engine after its updates, so it may sample with rollout_backend vllm
    samples_with_vllm: ClassVar[bool] = False

    @model_validator(mode="after")
    def _check_sampling(self):
        if self.rollout_backend != "hf" and not self.samples_with_vllm:
            # the message names the commands whose trainers sync an engine (grpo's config sets samples_with_vllm)
            raise ValueError(f"rollout_backend '{self.rollout_backend}' is supported by grpo, sft, ei and grpolab "
                             f"eval; {self.command} samples with the training model: use rollout_backend 'hf'")
        if self.vllm_device is not None:
            if self.rollout_backend == "hf":
                raise ValueError(f"vllm_device ({self.vllm_device!r}) places a vLLM engine: set rollout_backend "
                                 "vllm_server (or vllm), or leave vllm_device unset")
            if self.rollout_backend == "vllm_server" and self.vllm_server_url is not None:
                raise ValueError(f"vllm_device ({self.vllm_device!r}) places the server grpolab starts; the one at "
                                 "vllm_server_url runs where it was started (its CUDA_VISIBLE_DEVICES): unset one")
            if self.vllm_device != "cpu" and not self.vllm_device.startswith("cuda"):
                raise ValueError(f"vllm_device must be cpu, cuda or cuda:N, got {self.vllm_device!r}")
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
        if self.rollout_backend == "hf":
            return {}
        server = {} if self.rollout_backend == "vllm" else dict(
            server_url=self.vllm_server_url, timeout_s=self.vllm_server_timeout_s, device=self.vllm_device)
        return server | dict(gpu_memory_utilization=self.vllm_gpu_memory_utilization,
                    max_model_len=self.vllm_max_model_len,
                    tensor_parallel_size=self.vllm_tensor_parallel_size,
                    enable_sleep_mode=self.vllm_enable_sleep_mode,
                    dtype=self.dtype if self.vllm_dtype == "auto" else self.vllm_dtype,
                    cpu_kvcache_space_gib=self.vllm_cpu_kvcache_space_gib, enforce_eager=self.vllm_enforce_eager,
                    seed=self.seed)

    def sampling_params(self):
        """Rollout sampling (no seed of its own: the trainer's generator carries the state)."""
        return SamplingParams(temperature=self.sampling_temperature, top_p=self.sampling_top_p,
                              max_tokens=self.sampling_max_tokens, min_tokens=self.sampling_min_tokens,
                              stop=list(self.stop))

    def eval_sampling_params(self):
        """Validation sampling, seeded so every evaluation of a run sees the same draws."""
        return SamplingParams(temperature=self.eval_temperature, max_tokens=self.sampling_max_tokens,
                              min_tokens=self.sampling_min_tokens, stop=list(self.stop), seed=self.seed + 1)


class PolicyUpdateConfig(SampledRunConfig):
    """What GRPO and PPO share: rollout and optimizer batches, the clipped update, the KL to a frozen
    reference with its controller, and the KL early stop. The defaults are CS336's GRPO ones; a
    method with other defaults lists them in ``method_defaults`` (applied where a value is not given)."""

    method_defaults: ClassVar[dict[str, Any]] = {}

    # --- Batches and optimizer (CS336 Algorithm 3's names)
    rollout_batch_size: int = Field(256, ge=1)
    """Responses sampled per outer step: rollout_batch_size / group_size questions x group_size responses."""
    group_size: int = Field(8, ge=1)
    """Responses per question (GRPO's G); the group is the advantage's baseline (PPO: 1, one per question)."""
    train_batch_size: int = Field(256, ge=1)
    """Responses per optimizer step; below rollout_batch_size, each rollout batch takes several steps
    (off-policy after the first)."""
    gradient_accumulation_steps: int = Field(128, ge=1)
    """Micro-batches per optimizer step (micro-batch = train_batch_size / this rows): raise it to fit memory."""
    learning_rate: float = Field(1e-5, gt=0)
    """AdamW's peak learning rate."""
    cliprange: float = Field(0.2, gt=0)
    """The clipped loss's epsilon: the ratio pi/pi_old is clipped to [1 - cliprange, 1 + cliprange] (GRPO's
    grpo_clip, gspo, cispo; PPO's policy loss)."""
    whiten_advantages: bool = False
    """Whiten the advantages over the rollout batch (zero mean, unit variance) before the update."""
    warmup_steps: int = Field(1000, ge=0)
    """Linear learning-rate warm-up in optimizer steps, capped at 10 % of the run's optimizer steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: a constant learning rate, or cosine decay to 0 at the run's last optimizer step."""
    # --- KL to a frozen reference (the starting policy)
    kl_coef: float = Field(0.0, ge=0)
    """The KL penalty's coefficient (beta); 0: no KL anywhere, no reference model loaded, the controller off.
    GRPO adds it to the loss (kl_estimator); PPO subtracts kl_coef x k1 from each token's reward."""
    kl_adaptive: bool = False
    """Move kl_coef toward kl_target after each step (Ziegler et al. 2019), within [kl_coef_min, kl_coef_max]."""
    kl_target: float = Field(0.1, gt=0)
    """The KL the adaptive controller steers toward (GRPO: mean per token; PPO: summed per sequence)."""
    kl_horizon: int = Field(10000, ge=1)
    """The adaptive controller's horizon in responses: larger moves kl_coef more slowly."""
    kl_coef_min: float = Field(0.1, ge=0)
    """The adaptive coefficient's lower bound."""
    kl_coef_max: float = Field(0.3, ge=0)
    """The adaptive coefficient's upper bound."""
    kl_stop: float | None = Field(None, gt=0)
    """CS336 has no such stop; set e.g. 0.3 to pause updates when approx KL(old || current) exceeds it: the rest of the
    rollout batch's steps are skipped, said and counted (train/skipped_updates). PPO: 0.3."""
    token_record_groups: int = Field(2, ge=0)
    """Sampled groups per step whose per-token figures go to tokens.jsonl for grpolab view (0: none, no cost)."""

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
            raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must be divisible by train_batch_size "
                             f"({self.train_batch_size})")
        if self.kl_coef_min > self.kl_coef_max:
            raise ValueError(f"kl_coef_min ({self.kl_coef_min}) exceeds kl_coef_max ({self.kl_coef_max})")
        return self

    def kl_controller(self):
        """The KL coefficient's controller: fixed (0 when kl_coef is 0), or adaptive."""
        if self.kl_adaptive and self.kl_coef > 0:
            return AdaptiveKLController(self.kl_coef, self.kl_target, self.kl_horizon, self.kl_coef_min,
                                        self.kl_coef_max)
        return FixedKLController(self.kl_coef)
