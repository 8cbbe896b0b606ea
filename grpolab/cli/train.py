"""The training commands: ``grpolab grpo|sft|ei|ppo|dpo|rm --config FILE --field value``. Their
``--help`` lists every field of the command's config with its type, default and description."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand

from ..algorithms import METHODS
from .base import EXTRA, _fail, _quiet_hf, _user_errors, app


def _trainers():
    """Every training command's (config class, trainer function), from ``algorithms.METHODS``
    (``plan`` reads a config under any of them; a command that trains loads only its own)."""
    return {name: method.load() for name, method in METHODS.items()}


def _trainer(command: str):
    """The command's (config class, trainer function): its method's module only."""
    return METHODS[command].load()


def _build(config_cls, config: Optional[Path], args: list[str], resume: Optional[Path]):
    """The config of a fresh run (``--config`` + ``--field value``), or of a resumed one: the run's
    own saved config, with only the fields a resume may change taken from the command line."""
    from ..training.config import parse_overrides
    from ..training.run_dir import CONFIG_FILE

    overrides = parse_overrides(args)
    if resume is None:
        return config_cls.build(config, overrides)
    saved = resume / CONFIG_FILE
    if not saved.is_file():
        raise FileNotFoundError(f"{resume}: not a run directory (no {CONFIG_FILE})")
    overrides["run_dir"] = str(resume)
    return config_cls.build(config or saved, overrides)


CONFIG_OPT = typer.Option(None, "--config", "-c", help="YAML config (configs/*.yaml).")
RESUME_OPT = typer.Option(None, "--resume", help="Continue the run in this run directory, under its own config.")
OVERWRITE_OPT = typer.Option(False, "--overwrite", help="Replace a run already in run_dir (otherwise refused).")


def _train(command: str, ctx, config, resume=None, overwrite: bool = False):
    """Build the command's config from the file and the --field value overrides, train, return the
    result; a user error is one line on stderr and exit code 2, Ctrl-C one line and exit code 130."""
    from ..rollout import RolloutBackendError
    from ..training.run import RunInterrupted

    _quiet_hf()
    config_cls, train = _trainer(command)
    try:
        cfg = _build(config_cls, config, list(ctx.args), resume)
        from ..training.preflight import check_imports

        check_imports(cfg)  # a reward/tool module that hangs or exits at import: one line, nothing touched
    except _user_errors() as exc:
        _fail(str(exc))
    try:
        return train(cfg, resume=resume is not None, overwrite=overwrite)
    except RunInterrupted as exc:  # Ctrl-C 130, SIGTERM 143
        typer.echo(f"grpolab: {exc}", err=True)
        raise typer.Exit(exc.exit_code)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, but say where the run can continue from
        typer.echo(f"grpolab: stopped at once; {_continue_from(cfg, command)}", err=True)
        raise typer.Exit(130)
    except RolloutBackendError as exc:  # the sampler process or the vLLM server died: resumable
        _fail(f"{exc}; {_continue_from(cfg, command)}")
    except _user_errors() as exc:
        _fail(str(exc))
    except Exception as exc:  # a full disk surfaces as OSError, or wrapped by safetensors/torch
        if _disk_full(exc) and "shared memory" in str(exc):  # torch's share_memory_ in /dev/shm (case A17)
            _fail(f"no space left in shared memory (/dev/shm: {_free_mb('/dev/shm')}): the sampler process of "
                  "max_staleness >= 1 keeps a staging copy of the weights there (about the model's size); give it "
                  "more (Docker: --shm-size) or use max_staleness 0")
        if _disk_full(exc):
            _fail(f"no space left on device: {getattr(exc, 'filename', None) or cfg.run_dir}")
        raise


def _continue_from(cfg, command: str) -> str:
    """Where the run can continue from: its newest checkpoint and the command, or that there is none."""
    from ..training.checkpoints import CheckpointManager
    from ..training.run_dir import CHECKPOINTS_DIR

    newest = CheckpointManager(Path(cfg.run_dir) / CHECKPOINTS_DIR).latest()
    return (f"newest checkpoint {newest}; continue with: grpolab {command} --resume {cfg.run_dir}" if newest
            else "no checkpoint was written")


def _free_mb(path: str) -> str:
    try:
        st = os.statvfs(path)
    except OSError:
        return "size unknown"
    return f"{st.f_bavail * st.f_frsize / 2**20:.0f} of {st.f_blocks * st.f_frsize / 2**20:.0f} MB free"


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
        fmt = f"  format rate: {after['format_rate']:.3f}" if "format_rate" in after else ""  # a rubric may have none
        typer.echo(f"validation accuracy: {after['accuracy']:.3f}{fmt}")


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


def _report_distill(result) -> None:
    if result.before and "reverse_kl" in result.before and result.after and "reverse_kl" in result.after:
        typer.echo(f"held-out reverse KL to the teacher (per token): {result.before['reverse_kl']:.4f} -> "
                   f"{result.after['reverse_kl']:.4f}")
    _report(result)


# how each command reports its result; its help, config and trainer are in algorithms.METHODS
REPORTS = {"grpo": _report, "sft": _report_sft, "ei": _report_ei, "ppo": _report, "dpo": _report_dpo, "rm": _report_rm,
           "distill": _report_distill}


FIELDS_INTRO = ("Config fields: each can be given as --field value (dashes or underscores) or as a key of the "
                "--config file; `grpolab config {command}` prints them all as commented YAML. A text field takes "
                "the value as typed (null: none, where it may be null); any other reads it as YAML: 3, true, "
                "[a, b], {{k: v}}.")


class TrainingCommand(TyperCommand):
    """A training command whose ``--help`` goes on with every field of its config, one panel per
    section (``cli/fields.py``: read from its snapshot, so the help imports no method module)."""

    def format_help(self, ctx, formatter) -> None:
        super().format_help(ctx, formatter)
        from .fields import command_fields, sections

        groups = sections(command_fields(self.name))
        intro = FIELDS_INTRO.format(command=self.name)
        if not (getattr(typer.core, "HAS_RICH", False) and self.rich_markup_mode is not None):
            formatter.write_paragraph()
            formatter.write_text(intro)
            for title, rows in groups:
                with formatter.section(title):
                    formatter.write_dl([(f"{f.option} {f.type} [default: {f.default}]", f.description) for f in rows])
            return
        from rich.console import Group
        from rich.padding import Padding
        from rich.panel import Panel
        from rich.text import Text
        from typer import rich_utils

        console = rich_utils._get_rich_console()
        console.print(Padding(Text(intro), (0, 1, 1, 1)))
        for title, rows in groups:
            items = []
            for f in rows:
                head = Text(f.option, style="bold cyan")
                head.append(f" {f.type}", style="yellow")
                head.append(f"  [default: {f.default}]", style="dim")
                items += [head, Padding(Text(f.description), (0, 0, 0, 2))]
            console.print(Panel(Group(*items), title=title, title_align="left", border_style="dim"))


def _add_training_command(name: str, help_text: str, report) -> None:
    def command(ctx: typer.Context, config: Optional[Path] = CONFIG_OPT, resume: Optional[Path] = RESUME_OPT,
                overwrite: bool = OVERWRITE_OPT) -> None:
        report(_train(name, ctx, config, resume, overwrite))

    app.command(name, context_settings=EXTRA, help=help_text, cls=TrainingCommand)(command)


for _name, _method in METHODS.items():
    _add_training_command(_name, _method.help, REPORTS[_name])
