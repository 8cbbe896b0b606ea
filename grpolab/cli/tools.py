"""``grpolab view`` (the run viewer) and ``grpolab plan`` (the memory planner)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..algorithms import METHODS
from .base import EXTRA, _fail, _quiet_hf, _user_errors, app, or_list
from .train import _trainers


@app.command()
def view(
    run_dirs: list[Path] = typer.Argument(...,
                                          help="Run directories (each with metrics.jsonl); later ones are overlaid."),
    out: Optional[Path] = typer.Option(None, "--out",
                                       help="The HTML file (default: view.html in the first run directory)."),
    serve: bool = typer.Option(False, "--serve", help="Serve the page on 127.0.0.1 (rebuilt at each load) instead."),
    port: int = typer.Option(8000, "--port", help="With --serve: the port (0: any free one)."),
) -> None:
    """A run's curves, config and per-token records (tokens.jsonl) in one self-contained HTML page."""
    from ..viewer import make_server, render, write_report

    try:
        if serve and not 0 <= port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {port}")
        if not serve or out is not None:
            typer.echo(f"wrote {write_report(run_dirs, out)}")
        if not serve:
            return
        render(run_dirs)  # every run directory is readable before the server starts
    except _user_errors() as exc:
        _fail(str(exc))
    try:
        server = make_server(run_dirs, port)
    except OSError as exc:
        _fail(f"--port {port}: cannot listen on 127.0.0.1 ({exc.strerror or exc})")
    typer.echo(f"serving http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@app.command(context_settings=EXTRA)
def plan(
    ctx: typer.Context,
    config: Path = typer.Option(
        ..., "--config", "-c", help="Any trainer's YAML config; --field value overrides follow."
    ),
    gpus: Optional[int] = typer.Option(None, "--gpus",
                                       help="GPUs (one rank each); without it: this machine's CPU and memory."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", help="Memory of each GPU in GiB (e.g. 80)."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="On the CPU: processes (torchrun --nproc_per_node)."),
    method: Optional[str] = typer.Option(None, "--method",
                                         help=f"{or_list(METHODS)} (default: from the config's steps key)."),
    architecture: Optional[str] = typer.Option(
        None,
        "--architecture",
        help="A named model shape (Qwen2.5-Math-1.5B, Qwen2.5-Math-7B) instead of the model's config.json.",
    ),
    prompt_tokens: Optional[int] = typer.Option(
        None, "--prompt-tokens", help="Prompt length (default: the longest training prompt, where the data is here)."
    ),
) -> None:
    """Per-rank memory of a run (weights, gradients, AdamW, activations, log-prob buffers, reference,
    vLLM) from its config and the model's config.json, whether it fits, and the largest micro-batch."""
    _quiet_hf()
    from ..training.config import parse_overrides
    from ..training.memory_plan import config_for_plan, estimate, format_plan
    from ..training.plan_inputs import Hardware

    try:
        cfg = config_for_plan(_trainers(), config, parse_overrides(list(ctx.args)), method)
        hw = Hardware.detect(gpus, gpu_memory, nproc)
        typer.echo(format_plan(estimate(cfg, hw, architecture, prompt_tokens), cfg))
    except _user_errors() as exc:
        _fail(str(exc))
