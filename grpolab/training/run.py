"""``Run``: the one owner of a training run, shared by every trainer.

A trainer holds only its algorithm; the ``Run`` holds everything around it:

- the run directory (``run_dir.py``: its files, its lock, the checks) — claimed first, and
  touched only once every input, the model, the tool environment and the checkpoint to resume
  from have been checked;
- the model (``run_setup.py``): from the newest readable checkpoint when resuming, else the one
  given, else ``cfg.model``; seeded, on its device, dropout disabled; under its engine and LoRA
  (``run_model.py``);
- every state a trainer registers with ``track`` (optimizer, scheduler, data position, KL
  controller, health streaks, RNG generators, extra models), saved in atomic checkpoints and
  restored on ``--resume`` so a resumed run equals an uninterrupted one;
- metrics (``log``), validation (``validate``), the guarded optimizer step (non-finite steps are
  skipped and counted), Ctrl-C and SIGTERM (a checkpoint at the next safe point and a ``--resume``
  hint; a second one stops at once),
  the final model (written atomically) and the ``TrainResult``.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..models import load_model_and_tokenizer
from . import distributed
from .checkpoints import CheckpointManager, find_resume_checkpoint
from .health import NonFiniteWeightsError
from .metric_logging import MetricsLogger, progress
from .optimization import StepResult, current_lr, nonfinite_parameters
from .run_dir import CHECKPOINTS_DIR, FINAL_DIR, METRICS_FILE, PLOT_FILE, claim_run_dir, prepare_run_dir
from .run_model import RunModel, check_distributed
from .run_setup import (
    autocast_for,
    build_run_env,
    check_backend,
    load_run_model,
    resolve_device,
    seed_everything,
    set_cpu_threads,
)


class RunInterrupted(Exception):
    """Ctrl-C (or SIGTERM) stopped the run at a safe point; the message says how to resume;
    ``exit_code`` is 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


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
        self._on_close: list[Callable[[], Any]] = []
        self.cfg, self.step_key, self.total_steps = cfg, cfg.step_key, cfg.total_steps
        self.path = Path(cfg.run_dir)
        self.claim = None  # the run directory's lock (rank 0), taken before anything in it is touched
        self.dist = distributed.setup(cfg.distributed, resolve_device(cfg.device),
                                      deepspeed_config=cfg.deepspeed_config, fsdp_cpu_offload=cfg.fsdp_cpu_offload)
        self.is_main = self.dist.is_main
        try:
            check_distributed(cfg, self.dist)
            self.claim = claim_run_dir(self.path, resume, overwrite, self.is_main)  # one writer per run directory
            self._start(cfg, resume, overwrite, model, tokenizer, check_inputs)
        except BaseException:
            if self.claim is not None:
                self.claim.release(started=False)
            distributed.teardown(barrier=False)  # this rank may be the only one failing: never wait for the others
            raise

    def _start(self, cfg, resume, overwrite, model, tokenizer, check_inputs) -> None:
        self.ckpts = CheckpointManager(self.path / CHECKPOINTS_DIR, cfg.keep_last)
        self.resumed_from, self.state = find_resume_checkpoint(self.ckpts, cfg, self.path) if resume else (None, None)
        seed_everything(cfg.seed, cfg.deterministic)
        self.device = distributed.device_for(resolve_device(cfg.device))
        # no thread probe per torchrun rank, nor in a deterministic run
        probe = not (cfg.deterministic or self.dist.enabled)
        set_cpu_threads(cfg, self.device, probe=probe)  # and dtype auto's probe, in load_run_model
        model, self.tokenizer = load_run_model(cfg, self._load_model, self.resumed_from, model, tokenizer,
                                               device=self.device, probe=probe)
        # the engine (DDP/FSDP2/DeepSpeed), LoRA, and the plain copy the sampler draws from
        self.weights = RunModel(cfg, model.to(self.device), self.device, self.state)
        # every trainer forward's context: bf16 autocast where asked, the compiled layers where compile is on
        self.autocast = self.weights.forward_context(autocast_for(getattr(cfg, "dtype", "float32"), self.device))
        if check_inputs is not None:  # e.g. prompts fit the context, the rollout fits memory
            check_inputs(self.sampling_model, self.tokenizer, self.device)
        self.env = build_run_env(cfg, self.tokenizer)  # tools, retrieval index: built before the directory is touched
        check_backend(cfg, self.device)  # the rollout backend's options, before anything is touched
        distributed.barrier()  # every rank has checked everything before rank 0 touches the directory
        # inputs are valid and the model loaded: only now is the directory touched
        if self.is_main:
            prepare_run_dir(self.path, cfg.to_dict(), clear=overwrite and not resume)
        self.metrics_path = self.path / METRICS_FILE
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
        self._nonfinite_at_start: int | None = None  # parameter tensors holding NaN or inf before the first step
        self._tracked: dict[str, Any] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._interrupts, self._stop_signal = 0, signal.SIGINT
        self._old_handlers: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):  # SIGTERM: timeout, a scheduler, docker stop (A11)
                self._old_handlers[sig] = signal.signal(sig, self._on_sigint)
        self.bar = progress(
            self.total_steps, cfg.command.upper(), cfg.show_progress and self.is_main, initial=self.step
        )
        if self.state is not None:  # after the model is loaded: nothing below may draw from it before the loop
            torch.set_rng_state(self._rank_rng()["torch"])

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
        if isinstance(obj, torch.nn.Module) and self.weights.compiled is not None:
            self.weights.compiled.adopt(obj)  # a reference policy's copy: its forwards run compiled too
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
        if self._nonfinite_at_start is None:  # what the model held before this process's first step
            self._nonfinite_at_start = self._nonfinite_tensors(optimizer)
            if self._nonfinite_at_start:
                self.bar.write(f"grpolab health: the model holds NaN or inf in {self._nonfinite_at_start} parameter "
                               "tensor(s) before training: every step whose loss they reach is skipped")
        try:
            result = self.weights.optimizer_step(parameters_of, optimizer, scheduler, loss)
        except RuntimeError as exc:  # torch: "value cannot be converted to type float without overflow"
            if "overflow" not in str(exc):
                raise
            raise NonFiniteWeightsError(
                f"optimizer step {self.train_step}: AdamW's update overflows float32 (learning_rate "
                f"{getattr(self.cfg, 'learning_rate', None)}); stopped before any checkpoint of it is written. "
                "Lower learning_rate.") from None
        if result.skipped:
            self.nonfinite_steps += 1
            self.bar.write(
                f"grpolab health: optimizer step {self.train_step} skipped: the loss or gradient norm is not "
                f"finite (loss {loss}, grad norm {result.grad_norm}); {self.nonfinite_steps} skipped so far. "
                "Lower learning_rate, use float32, or check the rewards and advantage_eps."
            )
        self._check_weights(optimizer)
        return result

    def _nonfinite_tensors(self, optimizer) -> int:
        """How many of the tensors ``optimizer`` updates hold a NaN or an inf: the most of any rank
        (its own shards), so every rank reads the same count."""
        bad, self._parameter_tensors = nonfinite_parameters(getattr(optimizer, "optimizer", optimizer))
        if self.dist.enabled:  # a tensor on the run's device: NCCL reduces no CPU tensor
            bad = int(distributed.all_reduce(torch.tensor(bad, device=self.device), "max"))
        return bad

    def _check_weights(self, optimizer) -> None:
        """Stop the run, before a checkpoint or final/ holds them, when the step left a NaN or an inf
        in weights that had none before the first step. Every rank checks every step, so all ranks
        stop together even where one skipped a step that another applied."""
        bad, total = self._nonfinite_tensors(optimizer), self._parameter_tensors
        if bad > self._nonfinite_at_start:
            raise NonFiniteWeightsError(
                f"optimizer step {self.train_step}: {bad} of {total} parameter tensors hold NaN or inf after the "
                f"update (learning_rate {getattr(self.cfg, 'learning_rate', None)}); stopped before any checkpoint "
                "of them is written. Lower learning_rate, or use float32.")

    def update_record(self, record: dict[str, Any], result: StepResult, optimizer=None) -> dict[str, Any]:
        """One optimizer step's record with its gradient norm, learning rate, whether this update was
        skipped (``train/skipped_updates``, by reason) and the count of skipped (non-finite) steps so far."""
        extra = {"train/grad_norm": result.grad_norm, "health/nonfinite_steps": self.nonfinite_steps,
                 "train/skipped_updates": int(result.skipped), "train/skipped_updates_nonfinite": int(result.skipped)}
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
            name = "SIGTERM" if self._stop_signal == signal.SIGTERM else "Ctrl-C"
            raise RunInterrupted(f"interrupted after step {done} ({name}); checkpoint {saved}. Continue with: "
                                 f"grpolab {self.cfg.command} --resume {self.path}", 128 + int(self._stop_signal))

    def _on_sigint(self, signum, frame) -> None:
        """Ctrl-C or SIGTERM: a checkpoint after this step; a second one stops at once."""
        self._interrupts += 1
        if self._interrupts > 1:  # a second signal: stop at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self._stop_signal = signum
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        print(f"\ngrpolab: {name}: stopping after this step and writing a checkpoint (Ctrl-C again to stop now)",
              file=sys.stderr)

    # ------------------------------------------------------------ the end

    def finish(self, after: dict[str, float], *, before: dict[str, float] | None = None, extra_files=None,
               plot: Callable[[Path, Path], Any] | None = None, **result) -> TrainResult:
        """Save ``final/`` atomically, close the metrics, plot, and return the ``TrainResult``."""
        self.weights.refresh()
        final = self.weights.save_final(self.tokenizer, self.path / FINAL_DIR, extra_files)
        self.close()
        if plot is not None:
            plot(self.metrics_path, self.path / PLOT_FILE)
        return TrainResult(self.path, final, self.metrics_path, after, time.perf_counter() - self.wall,
                           before=before, **result)

    def close(self, failed: bool = False) -> None:
        """End the run. ``failed``: an exception is leaving it, perhaps on this rank alone, so the
        process group is left without a barrier: a rank waiting there for ranks that are waiting in
        a training collective would hang until gloo's timeout instead of exiting for torchrun to see."""
        for callback in self._on_close:  # e.g. a sampler process, whatever way the run ends
            callback()
        self._on_close.clear()
        self.bar.close()
        self.logger.close()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        distributed.teardown(barrier=not failed)
        self.claim.release()

    def on_close(self, callback: Callable[[], Any]) -> None:
        """Call ``callback`` when the run closes (finished, stopped or failed), in the order given."""
        self._on_close.append(callback)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


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
