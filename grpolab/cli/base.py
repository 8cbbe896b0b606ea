"""What every command module shares: the typer ``app`` the commands register on, the one-line user
errors (``_fail``, ``_user_errors``), the quiet Hugging Face logging, the boolean-flag convention
(``boolean_flag_values``) and ``main``, the ``grpolab`` command."""

from __future__ import annotations

import logging
import os

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="GRPO and the methods it is measured against, for Hugging Face causal LMs.")

EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


def _quiet_hf() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # save_pretrained imports DeepSpeed where it is installed (accelerate's unwrap), which warns on
    # every CPU machine that it found no GPU; its own warnings (a deepspeed run) stay
    logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to CPU" not in record.getMessage())


def or_list(names) -> str:
    """``a, b or c``: the names a value may take, for a help text."""
    names = list(names)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def _fail(message: str) -> None:
    typer.echo(f"grpolab: error: {message}", err=True)
    raise typer.Exit(2)


def _user_errors():
    from ..data import DataError, TemplateError
    from ..training.config import ConfigError
    from ..training.health import NonFiniteWeightsError

    return (ConfigError, DataError, TemplateError, ValueError, FileNotFoundError, NotADirectoryError,
            IsADirectoryError, PermissionError, NonFiniteWeightsError)


def boolean_flag_values(argv: list[str]) -> list[str]:
    """One convention for every boolean on every command: ``--flag``, ``--flag true`` and ``--flag
    false`` (config fields already take a value; typer's own flags — ``--overwrite``, ``--ei``,
    ``--tools``, ``--entropy`` — take none, so a value after one is folded into the flag here)."""
    command = typer.main.get_command(app)  # typer's own click (vendored in recent typer): duck-typed
    name = next((a for a in argv if not a.startswith("-")), None)
    sub = getattr(command, "commands", {}).get(name) if name else None
    if sub is None:
        return argv
    flags: dict[str, str | None] = {}  # --flag -> its off form (None: drop it)
    for param in sub.params:
        if getattr(param, "is_flag", False) and getattr(param, "is_bool_flag", False):
            for opt in param.opts:
                flags[opt] = param.secondary_opts[0] if param.secondary_opts else None
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        value = argv[i + 1].lower() if arg in flags and i + 1 < len(argv) else None
        if value in ("true", "false", "yes", "no", "1", "0"):
            if value in ("true", "yes", "1"):
                out.append(arg)
            elif flags[arg] is not None:
                out.append(flags[arg])
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def main() -> None:
    """The ``grpolab`` command (``boolean_flag_values``, then the typer app with every command,
    registered by importing ``grpolab.cli``)."""
    import sys

    _working_directory_last(sys.path)
    try:
        app(args=boolean_flag_values(sys.argv[1:]), prog_name="grpolab")
    except (ImportError, MemoryError) as exc:
        if not isinstance(exc, MemoryError) and not any(sign in str(exc) for sign in OUT_OF_MEMORY):
            raise
        sys.exit(f"grpolab: error: out of memory ({_address_limit()}): {_last_line(exc)}")


def _working_directory_last(path: list[str]) -> None:
    """The console script imports ``module:function`` rewards, tools and environments from the
    working directory as ``python -m grpolab`` does (reliability case O01), searched last, after
    the installed packages (docs/guides/safety-and-recovery.md), as the reward workers search it."""
    cwd = os.getcwd()
    for entry in path:
        try:
            if entry in ("", ".") or os.path.samefile(entry, cwd):
                return
        except OSError:
            continue
    path.append(cwd)


# how a shared library that cannot be mapped (an address-space limit, ulimit -v) reads as an ImportError
OUT_OF_MEMORY = ("failed to map segment", "Cannot allocate memory", "cannot allocate memory")


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _address_limit() -> str:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return "the machine's memory is exhausted"
    return f"the address-space limit (ulimit -v) is {soft / 2**30:.2f} GiB; grpolab with torch needs about 1.2 GiB"
