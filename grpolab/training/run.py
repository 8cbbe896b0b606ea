"""``Run``: the one owner of a training run, shared by every trainer.

A trainer holds only its algorithm; the ``Run`` holds everything around it:

- the run directory (``config.yaml``, ``metrics.jsonl``, ``samples/``, ``checkpoints/step_N/``,
  ``final/``) — refused if it already holds a run, unless resuming or ``overwrite``, and always
  refused while another process holds its lock (``.lock``: one writer per run directory, held by
  rank 0 for the run's lifetime, naming the holder's pid); nothing in it is touched before every
  input, the model, the tool environment and the checkpoint to resume from have been checked;
- the model: from the newest readable checkpoint when resuming, else the one given, else
  ``cfg.model``; seeded, on its device, dropout disabled (``disable_dropout``);
- every state a trainer registers with ``track`` (optimizer, scheduler, data position, KL
  controller, health streaks, RNG generators, extra models), saved in atomic checkpoints and
  restored on ``--resume`` so a resumed run equals an uninterrupted one;
- metrics (``log``), validation (``validate``), the guarded optimizer step (non-finite steps are
  skipped and counted), Ctrl-C (a checkpoint at the next safe point and a ``--resume`` hint),
  the final model (written atomically) and the ``TrainResult``.
"""

from __future__ import annotations

import contextlib
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..eval import evaluate, log_generations
from ..models import load_model_and_tokenizer, set_logits_fp32
from . import distributed
from .checkpoints import (  # noqa: F401
    RUN_FILES,
    CheckpointManager,
    RunDirBusy,
    RunLock,
    atomic_write_text,
    check_run_dir,
    clear_run_dir,
    holds_a_run,
    remove_leftovers,
)
from .config import ConfigError, resume_changes
from .metric_logging import MetricsLogger, progress
from .optimization import StepResult, current_lr
from .resources import choose_cpu_threads
from .run_model import RunModel, check_distributed, frozen_copy  # noqa: F401 - re-exported for the trainers


class RunInterrupted(Exception):
    """Ctrl-C stopped the run at a safe point; the message says how to resume."""


@dataclass
class TrainResult:
    """What every trainer returns: where the run is, and the validation figures before/after."""

    run_dir: Path
    final_dir: Path
    metrics_path: Path
    after: dict[str, float]
    wall_s: float
    before: dict[str, float] | None = None
    n_examples: int | None = None  # SFT: training pairs after filtering
    filtered_sizes: list[int] = field(default_factory=list)  # expert iteration: kept responses per step


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, torch (and numpy when present) in one place; optionally deterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def autocast_for(dtype: str, device: torch.device | str):
    """bf16 autocast (weights stay fp32) where asked, else a no-op context."""
    if dtype == "bfloat16":
        device_type = torch.device(device).type
        return lambda: torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere (TRL's convention): log-probs that enter a ratio or a KL must be of
    the same distribution the sampler drew from."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


class Run:
    """See the module docstring. The config's ``step_key`` names the trainer's outer step in the
    metrics (``grpo_step``, ``ppo_step``, ...) and ``total_steps`` is its length; ``check_inputs(model,
    tokenizer, device)`` runs once the model is loaded, before the run directory is touched;
    ``load_model(path, **options) -> (model, tokenizer)`` replaces the causal-LM loader (``grpolab rm``
    loads sequence classifiers, from ``cfg.model`` and from its checkpoints alike)."""

    def __init__(self, cfg, *, resume: bool = False, overwrite: bool = False, model=None, tokenizer=None,
                 check_inputs=None, load_model=None):
        self._load_model = load_model or load_model_and_tokenizer
        self.wall = time.perf_counter()
        self.cfg, self.step_key, self.total_steps = cfg, cfg.step_key, cfg.total_steps
        self.path = Path(cfg.run_dir)
        self._lock, self._made_dir = None, False
        self.dist = distributed.setup(
            cfg.distributed,
            resolve_device(cfg.device),
            deepspeed_config=cfg.deepspeed_config,
            fsdp_cpu_offload=cfg.fsdp_cpu_offload,
        )
        self.is_main = self.dist.is_main
        try:
            check_distributed(cfg, self.dist)
            check_run_dir(self.path, resume=True, overwrite=True)  # a writable directory (or place for one)
            self._take_lock(resume, overwrite)  # one writer per run directory, before anything in it is touched
            check_run_dir(self.path, resume, overwrite)  # again, now that no other process can write it
            self._start(cfg, resume, overwrite, model, tokenizer, check_inputs)
        except BaseException:
            self._drop_lock(started=False)
            distributed.teardown(barrier=False)  # this rank may be the only one failing: never wait for the others
            raise

    def _take_lock(self, resume: bool, overwrite: bool) -> None:
        """Rank 0 takes ``run_dir/.lock`` (creating the directory if need be); a directory a live
        process holds is refused on every rank with the holder's pid, one that holds a run (without
        ``--resume``/``--overwrite``) with the usual hint — both before anything is created."""
        error = None
        if self.is_main:
            try:
                RunLock(self.path).check_free()
                check_run_dir(self.path, resume, overwrite)
                if not self.path.exists():
                    self.path.mkdir(parents=True)
                    self._made_dir = True
                self._lock = RunLock(self.path).acquire()
            except ConfigError as exc:
                error = str(exc)
            except OSError as exc:
                error = f"run_dir {self.path}: cannot create it ({exc.strerror or exc})"
        error = distributed.broadcast_object(error)
        if error is not None:
            self._drop_lock(started=False)
            raise RunDirBusy(error) if "is in use by" in error else ConfigError(error)

    def _drop_lock(self, started: bool = True) -> None:
        """Release the lock; a directory this run created and never used is removed again."""
        if self._lock is not None:
            self._lock.release(remove=not started)
            self._lock = None
        if self._made_dir and not started:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self._made_dir = False

    def _start(self, cfg, resume, overwrite, model, tokenizer, check_inputs) -> None:
        self.ckpts = CheckpointManager(self.path / "checkpoints", cfg.keep_last)
        self.resumed_from, self.state = None, None
        if resume:
            self._find_checkpoint(cfg)
        seed_everything(cfg.seed, cfg.deterministic)
        self.device = distributed.device_for(resolve_device(cfg.device))
        if self.device.type == "cpu":  # no probe per torchrun rank, nor in a deterministic run
            _, line = choose_cpu_threads(cfg.threads, probe=not (cfg.deterministic or self.dist.enabled))
            if line:
                print(f"grpolab: {line}", file=sys.stderr)
        gc = {"gradient_checkpointing": True} if cfg.gradient_checkpointing else {}
        if self.resumed_from is not None:
            model, tokenizer = self._load_model(str(self.resumed_from), trust_remote_code=cfg.trust_remote_code, **gc)
        elif model is None:
            model, tokenizer = self._load_model(cfg.model, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code, **gc)
        if cfg.disable_dropout:
            disable_dropout(model)
        if getattr(cfg, "logits_fp32", False):  # before any copy (sampler replica, reference) is made
            set_logits_fp32(model)
        self.tokenizer = tokenizer
        # the engine (DDP/FSDP2/DeepSpeed), LoRA, and the plain copy the sampler draws from
        self.weights = RunModel(cfg, model.to(self.device), self.device, self.state)
        self.autocast = autocast_for(getattr(cfg, "dtype", "float32"), self.device)
        if check_inputs is not None:  # e.g. prompts fit the context, the rollout fits memory
            check_inputs(self.sampling_model, self.tokenizer, self.device)
        self.env = self._build_env(cfg)  # the tools, the retrieval index: built before the directory is touched
        if getattr(cfg, "rollout_backend", "hf") == "vllm":  # the backend's options, before anything is touched
            from ..rollout.vllm import check_vllm_options

            check_vllm_options(**cfg.backend_options())
        distributed.barrier()  # every rank has checked everything before rank 0 touches the directory
        # inputs are valid and the model loaded: only now is the directory touched
        if self.is_main:
            if overwrite and not resume:
                clear_run_dir(self.path)
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "samples").mkdir(exist_ok=True)
            remove_leftovers(self.path)
            remove_leftovers(self.ckpts.root)
            atomic_write_text(self.path / "config.yaml", _yaml(cfg.to_dict()))
        self.metrics_path = self.path / "metrics.jsonl"
        if self.state is None and self.is_main:
            self.metrics_path.write_text("")
        self.logger = MetricsLogger(self.metrics_path, cfg.report_to, run_name=self.path.name, config=cfg.to_dict(),
                                    truncate_at=self.state.get("metrics_offset") if self.state else None) \
            if self.is_main else _NoLogger()
        counters = (self.state or {}).get("counters", {})
        self.step = int(counters.get("step", 0))
        self.train_step = int(counters.get("train_step", 0))
        self.eval_step = int(counters.get("eval_step", 0))
        self.nonfinite_steps = int(counters.get("nonfinite_steps", 0))
        self._tracked: dict[str, Any] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._interrupts = 0
        self._old_sigint = None
        if threading.current_thread() is threading.main_thread():
            self._old_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        self.bar = progress(
            self.total_steps, cfg.command.upper(), cfg.show_progress and self.is_main, initial=self.step
        )
        if self.state is not None:  # after the model is loaded: nothing below may draw from it before the loop
            torch.set_rng_state(self._rank_rng()["torch"])

    def _build_env(self, cfg):
        """The run's tool environment (``env:``), or None: its tools, custom tool modules and
        retrieval index are built (and so checked) before the run directory is touched."""
        options = getattr(cfg, "env", None)
        if options is None:
            return None
        from ..envs import build_env

        return build_env(**options, tokenizer=self.tokenizer)

    def _find_checkpoint(self, cfg) -> None:
        """The newest readable checkpoint, chosen by rank 0 (which alone moves unreadable ones aside)."""
        found = None
        if self.is_main:
            remove_leftovers(self.ckpts.root)
            found = self.ckpts.latest_loadable()
        path = distributed.broadcast_object(str(found[0]) if found else None)
        if path is None:
            raise ConfigError(f"{self.path}: nothing to resume (no readable checkpoint in {self.ckpts.root})")
        self.resumed_from = Path(path)
        self.state = found[1] if found else self.ckpts.load_state(self.resumed_from)
        changes = resume_changes(self.state.get("config", {}), cfg.to_dict(), cfg.steps_field)
        if changes.refused:
            raise ConfigError(f"--resume {self.path}: the run's config cannot change on resume: {changes.refused} "
                              f"(only {', '.join(changes.allowed_keys)} may)")
        done = int(self.state.get("counters", {}).get("step", 0))
        if done > cfg.total_steps:
            raise ConfigError(f"--resume {self.path}: the run has done {done} steps, more than "
                              f"{cfg.steps_field} {cfg.total_steps}; give at least {done}")
        if self.is_main:
            print(f"grpolab: resuming from {self.resumed_from}", file=sys.stderr)

    def _rank_rng(self) -> dict:
        """This rank's saved RNG states (each rank samples its own prompts with its own streams)."""
        per_rank = self.state.get("rng_ranks")
        return per_rank[self.dist.rank] if per_rank and self.dist.rank < len(per_rank) else self.state["rng"]

    @property
    def model(self):
        """The module trainers train (under DeepSpeed, the engine; under FSDP2, the sharded model)."""
        return self.weights.model

    @property
    def sampling_model(self):
        """The module to sample and evaluate from: the training model itself in one process or
        under DDP; a plain copy with the full (and, with LoRA, merged) weights under FSDP2/ZeRO-3
        or LoRA. Reading it after an optimizer step refreshes that copy (a collective under
        sharding: every rank reads it at the same point, e.g. when syncing the rollout backend);
        ``end_step`` refreshes it too, before validation."""
        self.weights.refresh()
        return self.weights.sampling_model

    # ------------------------------------------------------------ state

    @property
    def resuming(self) -> bool:
        return self.state is not None

    def track(self, name: str, obj):
        """Register ``obj`` (anything with ``state_dict``/``load_state_dict``: optimizer,
        scheduler, sampler, KL controller, health monitor, a module) for checkpoints; restores
        it now when resuming. Returns ``obj``."""
        self._tracked[name] = obj
        if isinstance(obj, torch.optim.Optimizer) and self.dist.sharded:
            self.weights.attach_optimizer(name, obj, self.resumed_from)
        elif self.state is not None and name in self.state:
            obj.load_state_dict(self.state[name])
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                # building a scheduler resets the optimizer's lr to its step-0 value; put back the saved one
                for group, lr in zip(obj.optimizer.param_groups, obj.get_last_lr()):
                    group["lr"] = lr
        return obj

    def track_rng(self, name: str, generator: torch.Generator) -> torch.Generator:
        """Register a sampling generator; when resuming, its state (and torch's) is restored."""
        self._generators[name] = generator
        if self.state is not None:
            generator.set_state(self._rank_rng()[name])
        elif self.dist.rank > 0:  # every rank draws its own samples
            generator.manual_seed(generator.initial_seed() + 1_000_003 * self.dist.rank)
        return generator

    def checkpoint(self, done: int) -> Path:
        """An atomic checkpoint after ``done`` outer steps, with every tracked state."""
        state = {name: obj.state_dict() for name, obj in self._tracked.items() if name != self.weights.optimizer_name}
        state["counters"] = {"step": done, "train_step": self.train_step, "eval_step": self.eval_step,
                             "nonfinite_steps": self.nonfinite_steps}
        state["rng"] = {"torch": torch.get_rng_state(), **{k: g.get_state() for k, g in self._generators.items()}}
        state["config"] = self.cfg.to_dict()
        state["metrics_offset"] = self.logger.offset()
        state["rng_ranks"] = distributed.all_gather_objects(state["rng"])
        module, weights, extra = self.weights.for_checkpoint()
        state.update(extra)
        return self.ckpts.save(done, module, self.tokenizer, state, state_dict=weights,
                               every_rank=self.weights.save_sharded)

    # ------------------------------------------------------------ the loop

    def steps(self):
        """The outer steps still to run: ``range(start, total_steps)``."""
        return range(self.step, self.total_steps)

    def log(self, record: dict[str, Any]) -> None:
        """Record figures (averaged over ranks; written by rank 0). Every rank calls it."""
        self.logger.log(distributed.mean_metrics(record))

    def optimizer_step(self, optimizer, scheduler, loss: float | None = None, parameters_of=None) -> StepResult:
        """The guarded optimizer step; a skipped (non-finite) step is counted and reported. Under an
        engine, gradients are reduced over ranks first (DeepSpeed: by its own step)."""
        result = self.weights.optimizer_step(parameters_of, optimizer, scheduler, loss)
        if result.skipped:
            self.nonfinite_steps += 1
            self.bar.write(
                f"grpolab health: optimizer step {self.train_step} skipped: the loss or gradient norm is not "
                f"finite (loss {loss}, grad norm {result.grad_norm}); {self.nonfinite_steps} skipped so far. "
                "Lower learning_rate, use float32, or check the rewards and advantage_eps."
            )
        return result

    def update_record(self, record: dict[str, Any], result: StepResult, optimizer=None) -> dict[str, Any]:
        """One optimizer step's record with its gradient norm, learning rate and the count of
        skipped (non-finite) steps so far."""
        extra = {"train/grad_norm": result.grad_norm, "health/nonfinite_steps": self.nonfinite_steps}
        if optimizer is not None:
            extra["train/lr"] = current_lr(optimizer)
        return {**record, **extra}

    def log_update(self, record: dict[str, Any], result: StepResult, optimizer=None) -> None:
        self.log(self.update_record(record, result, optimizer))

    def validate(self, step: int, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Run ``evaluate()`` and log its figures as ``eval/*`` with ``eval_step`` and the outer step."""
        metrics = evaluate()
        if metrics:
            self.log({"eval_step": self.eval_step, self.step_key: step, **{f"eval/{k}": v for k, v in metrics.items()},
                      "time/elapsed_s": time.perf_counter() - self.wall})
            self.eval_step += 1
        return metrics

    def end_step(self, done: int, validate: Callable[[int], Any] | None = None) -> None:
        """After outer step ``done``: periodic validation, periodic checkpoint, and Ctrl-C."""
        self.step = done
        self.bar.update(1)
        validating = validate is not None and self.cfg.eval_every and done % self.cfg.eval_every == 0 \
            and done < self.total_steps
        if validating or not self.weights.engine_holds_weights:  # a vLLM engine got them streamed
            self.weights.refresh()
        if validating:
            validate(done)
        saved = None
        if self.cfg.checkpoint_every and done % self.cfg.checkpoint_every == 0:
            saved = self.checkpoint(done)
        if self._interrupts:
            saved = saved or self.checkpoint(done)
            self.close()
            raise RunInterrupted(f"interrupted after step {done}; checkpoint {saved}. Continue with: "
                                 f"grpolab {self.cfg.command} --resume {self.path}")

    def _on_sigint(self, signum, frame) -> None:
        self._interrupts += 1
        if self._interrupts > 1:  # a second Ctrl-C: stop at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        print("\ngrpolab: Ctrl-C: stopping after this step and writing a checkpoint (Ctrl-C again to stop now)",
              file=sys.stderr)

    # ------------------------------------------------------------ the end

    def finish(self, after: dict[str, float], *, before: dict[str, float] | None = None, extra_files=None,
               plot: Callable[[Path, Path], Any] | None = None, **result) -> TrainResult:
        """Save ``final/`` atomically, close the metrics, plot, and return the ``TrainResult``."""
        self.weights.refresh()
        final = self.weights.save_final(self.tokenizer, self.path / "final", extra_files)
        self.close()
        if plot is not None:
            plot(self.metrics_path, self.path / "curves.png")
        return TrainResult(self.path, final, self.metrics_path, after, time.perf_counter() - self.wall,
                           before=before, **result)

    def close(self, failed: bool = False) -> None:
        """End the run. ``failed``: an exception is leaving it, perhaps on this rank alone, so the
        process group is left without a barrier: a rank waiting there for ranks that are waiting in
        a training collective would hang until gloo's timeout instead of exiting for torchrun to see."""
        self.bar.close()
        self.logger.close()
        if self._old_sigint is not None:
            signal.signal(signal.SIGINT, self._old_sigint)
            self._old_sigint = None
        distributed.teardown(barrier=not failed)
        self._drop_lock()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def validation(run: Run, backend, inputs, cfg, scorer=None) -> Callable[[int], dict[str, float]]:
    """``validate(step)``: accuracy on the validation examples (sampled as configured), logged with
    sample generations (CS336 ``log_generations``); {} when there is nothing to validate on."""
    sampling = cfg.eval_sampling_params()

    def measure(step: int) -> dict[str, float]:
        if not inputs.evals or inputs.reward is None:
            return {}
        evals = distributed.shard(inputs.evals)  # each rank evaluates its share; figures weighted by share
        reward = getattr(inputs, "eval_reward", None)  # beside a reward model: the task's verifier judges
        result = evaluate(backend, evals, inputs.template, reward or inputs.reward, sampling,
                          scorer=scorer if reward is None else None)
        extra = {}
        if cfg.log_generations_samples and run.is_main:
            extra = log_generations(run.path / "samples" / f"eval_step_{step}.jsonl", result, step,
                                    run.weights.sampling_model, run.tokenizer, cfg.log_generations_samples)
        return distributed.mean_metrics({**result.metrics, **extra}, weight=len(evals))

    return lambda step: run.validate(step, lambda: measure(step))


class _NoLogger:
    """Ranks other than 0 write no metrics."""

    def log(self, record) -> None:
        pass

    def offset(self) -> int:
        return 0

    def close(self) -> None:
        pass


class ListState:
    """A plain list as checkpoint state (e.g. expert iteration's filtered-set sizes so far)."""

    def __init__(self, items: list | None = None):
        self.items = list(items or [])

    def state_dict(self) -> list:
        return list(self.items)

    def load_state_dict(self, state) -> None:
        self.items[:] = list(state)
