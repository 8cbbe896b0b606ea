"""``grpolab config <command> [--config FILE] [--field value ...]``: every field of a training
command's config as commented YAML (each field's description above it, in its sections), with the
file and the overrides applied. The output loads back unchanged: ``grpolab <command> --config`` on
it trains the config it was printed from."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional

import typer

from ..algorithms import METHODS
from .base import EXTRA, _fail, _quiet_hf, _user_errors, app, or_list

WIDTH = 100  # the comments' width


def render_yaml(cfg, command: str) -> str:
    """``cfg`` as YAML, every field under its description, the sections as headings."""
    import yaml

    from .fields import describe, sections

    values = cfg.to_dict()
    out = [f"# grpolab {command}: every field of {type(cfg).__name__}, each under its description.",
           f"# Train with it: grpolab {command} --config FILE (any field also as --field value).", ""]
    for title, rows in sections(describe(type(cfg))):
        out += [f"# {'-' * 16} {title}".rstrip(), ""]
        for f in rows:
            out += textwrap.wrap(f.description, WIDTH - 2, initial_indent="# ", subsequent_indent="# ",
                                 break_on_hyphens=False, break_long_words=False)
            out.append(f"{f.name}: {_yaml_value(yaml, values[f.name])}")
        out.append("")
    return "\n".join(out)


def _yaml_value(yaml, value) -> str:
    """``value`` as one YAML flow value (a collection on one line), without the document end marker."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**6, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").rstrip("\n")


@app.command("config", context_settings=EXTRA)
def config_cmd(
    ctx: typer.Context,
    command: str = typer.Argument(..., help=f"A training command: {or_list(METHODS)}."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="A YAML config to start from."),
) -> None:
    """Print every field of a training command's config as commented YAML (the --config file and any
    --field value applied); it loads back unchanged."""
    from .train import _build, _trainer

    _quiet_hf()
    if command not in METHODS:
        _fail(f"unknown command {command!r}; expected one of {', '.join(METHODS)}")
    try:
        cfg = _build(_trainer(command)[0], config, list(ctx.args), resume=None)
    except _user_errors() as exc:
        _fail(str(exc))
    typer.echo(render_yaml(cfg, command))
