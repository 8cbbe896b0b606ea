"""The training commands: ``grpolab grpo|sft|ei|ppo|dpo|rm --config FILE --field value``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..algorithms import METHODS
from . import EXTRA, _fail, _quiet_hf, _user_errors, app


def _trainers():
    """Each training command's (config class, trainer function), from ``algorithms.METHODS``."""
    from ..algorithms import METHODS

    return {name: method.load() for name, method in METHODS.items()}


def _build(config_cls, config: Optional[Path], args: list[str], resume: Optional[Path]):
    """The config of a fresh run (``--config`` + ``--field value``), or of a resumed one: the run's
    own saved config, with only the fields a resume may change taken from the command line."""
    from ..training.config import parse_overrides

    overrides = parse_overrides(args)
    if resume is None:
        return config_cls.build(config, overrides)
    saved = resume / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(f"{resume}: not a run directory (no config.yaml)")
    overrides["run_dir"] = str(resume)
    return config_cls.build(config or saved, overrides)


CONFIG_OPT = typer.Option(None, "--config", "-c", help="YAML config (configs/*.yaml).")
RESUME_OPT = typer.Option(None, "--resume", help="Continue the run in this run directory, under its own config.")
OVERWRITE_OPT = typer.Option(False, "--overwrite", help="Replace a run already in run_dir (otherwise refused).")


def _train(command: str, ctx, config, resume=None, overwrite: bool = False):
    """Build the command's config from the file and the --field value overrides, train, return the
    result; a user error is one line on stderr and exit code 2, Ctrl-C one line and exit code 130."""
    from ..training.run import RunInterrupted

    _quiet_hf()
    config_cls, train = _trainers()[command]
    try:
        cfg = _build(config_cls, config, list(ctx.args), resume)
        from ..training.preflight import check_imports

        check_imports(cfg)  # a reward/tool module that hangs or exits at import: one line, nothing touched
    except _user_errors() as exc:
        _fail(str(exc))
    try:
        return train(cfg, resume=resume is not None, overwrite=overwrite)
    except RunInterrupted as exc:
        typer.echo(f"grpolab: {exc}", err=True)
        raise typer.Exit(130)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, but say where the run can continue from
        from ..training.checkpoints import CheckpointManager

        newest = CheckpointManager(Path(cfg.run_dir) / "checkpoints").latest()
        where = (f"newest checkpoint {newest}; continue with: grpolab {command} --resume {cfg.run_dir}" if newest
                 else "no checkpoint was written")
        typer.echo(f"grpolab: stopped at once; {where}", err=True)
        raise typer.Exit(130)
    except _user_errors() as exc:
        _fail(str(exc))
    except Exception as exc:  # a full disk surfaces as OSError, or wrapped by safetensors/torch
        if _disk_full(exc):
            _fail(f"no space left on device: {getattr(exc, 'filename', None) or cfg.run_dir}")
        raise


def _disk_full(exc: BaseException) -> bool:
    """A full disk however it surfaces: OSError errno 28, or torch's zip writer's RuntimeError
    (``inline_container.cc``: "file write failed", "unexpected pos"), also as the cause of another."""
    seen = 0
    while exc is not None and seen < 5:
        text = str(exc)
        if (getattr(exc, "errno", None) == 28 or "No space left on device" in text or "file write failed" in text
                or "unexpected pos" in text or "errno 28" in text.lower()):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _report(result) -> None:
    typer.echo(
        f"run directory: {result.run_dir}\nfinal model:   {result.final_dir}\nmetrics:       {result.metrics_path}"
    )
    after = getattr(result, "after", None)
    if after and "accuracy" in after:
        typer.echo(f"validation accuracy: {after['accuracy']:.3f}  format rate: {after['format_rate']:.3f}")


def _report_sft(result) -> None:
    typer.echo(f"trained on {result.n_examples} examples")
    _report(result)


def _report_ei(result) -> None:
    typer.echo(f"filtered set sizes: {result.filtered_sizes}")
    _report(result)


def _report_dpo(result) -> None:
    if result.before is not None:
        typer.echo(f"held-out preference accuracy: {result.before['preference_accuracy']:.3f} -> "
                   f"{result.after['preference_accuracy']:.3f}")
    _report(result)


def _report_rm(result) -> None:
    if result.before is not None:
        typer.echo(f"held-out pairwise accuracy: {result.before['pairwise_accuracy']:.3f} -> "
                   f"{result.after['pairwise_accuracy']:.3f}")
    _report(result)


# how each command reports its result; its help, config and trainer are in algorithms.METHODS
REPORTS = {"grpo": _report, "sft": _report_sft, "ei": _report_ei, "ppo": _report, "dpo": _report_dpo, "rm": _report_rm}


def _add_training_command(name: str, help_text: str, report) -> None:
    def command(ctx: typer.Context, config: Optional[Path] = CONFIG_OPT, resume: Optional[Path] = RESUME_OPT,
                overwrite: bool = OVERWRITE_OPT) -> None:
        report(_train(name, ctx, config, resume, overwrite))

    app.command(name, context_settings=EXTRA, help=help_text)(command)


for _name, _method in METHODS.items():
    _add_training_command(_name, _method.help, REPORTS[_name])
