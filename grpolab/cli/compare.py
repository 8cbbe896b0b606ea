"""``grpolab compare`` and ``grpolab demo``: the studies of ``grpolab.experiments``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .base import _fail, _quiet_hf, _user_errors, app
from .fields import typer_options

# every option's flag, default and help are its field's in ``options.CompareOptions`` / ``DemoOptions``
# (read from the snapshot)
compare_option, demo_option = typer_options("compare"), typer_options("demo")


@app.command()
def compare(
    run_dir: Path = compare_option("run_dir"),
    seed: int = compare_option("seed"),
    steps: Optional[int] = compare_option("steps"),
    k: int = compare_option("k"),
    test_examples: Optional[int] = compare_option("test_examples"),
    ei: bool = compare_option("ei"),
    warm_steps: Optional[int] = compare_option("warm_steps"),
    variants: Optional[str] = compare_option("variants"),
    seeds: int = compare_option("seeds"),
    model: Optional[str] = compare_option("model"),
    data: Optional[str] = compare_option("data"),
    backend: str = compare_option("backend"),
    env: Optional[Path] = compare_option("env"),
) -> None:
    """MLE vs PPO vs GRPO (and optionally expert iteration) from one warm start, equal sample budgets;
    or, with --variants, GRPO variants over several seeds."""
    given = dict(locals())  # the parameters, by name: CompareOptions validates them
    _quiet_hf()
    from .options import CompareOptions

    try:
        opts = CompareOptions.from_cli(given)
        if opts.variants is not None:
            from ..experiments.presets import REAL_VARIANTS_STEPS, VARIANTS_STEPS, VARIANTS_WARM_STEPS
            from ..experiments.variants import parse_variants, run_variants
            from ..models.loading import model_directory

            # a bad directory is one line before anything trains
            model_dir = str(model_directory(opts.model)) if opts.model is not None else None
            run_variants(
                opts.run_dir,
                parse_variants(opts.variants),
                seeds=opts.seeds,
                steps=opts.steps or (REAL_VARIANTS_STEPS if model_dir else VARIANTS_STEPS),
                warm_steps=opts.warm_steps if opts.warm_steps is not None else (
                    0 if model_dir or opts.data else VARIANTS_WARM_STEPS),
                test_examples=opts.test_examples or (50 if model_dir else 200),
                model=model_dir,
                data=opts.data,
            )
            return
        from ..envs import load_env_file
        from ..experiments.compare import run_compare

        env_options = load_env_file(opts.env) if opts.env is not None else None  # checked before any training
        run_compare(opts.run_dir, seed=opts.seed, steps=opts.steps or 100, k=opts.k,
                    test_examples=opts.test_examples or 200, include_ei=opts.ei, warm_steps=opts.warm_steps,
                    backend=opts.backend, env=env_options)
    except _user_errors() as exc:
        _fail(str(exc))


@app.command()
def demo(
    run_dir: Path = demo_option("run_dir"),
    seed: int = demo_option("seed"),
    sft_steps: Optional[int] = demo_option("sft_steps"),
    grpo_steps: Optional[int] = demo_option("grpo_steps"),
    test_examples: Optional[int] = demo_option("test_examples"),
    tools: bool = demo_option("tools"),
    dtype: str = demo_option("dtype"),
) -> None:
    """The main job: SFT warm-up on imperfect demonstrations, then GRPO, on the embedded tiny model;
    prints a before/after table and writes metrics, a plot, summary.json and the final model.
    With --tools: the same on questions about invented entities, with a live BM25 search tool."""
    given = dict(locals())  # the parameters, by name: DemoOptions validates them
    _quiet_hf()
    from .options import DemoOptions

    try:
        opts = DemoOptions.from_cli(given)
        steps = {"sft_steps": opts.sft_steps, "grpo_steps": opts.grpo_steps, "test_examples": opts.test_examples}
        if opts.tools:
            from ..experiments.demo_tools import run_tools_demo

            run_dir = opts.run_dir if opts.run_dir != Path("runs/demo") else Path("runs/demo_tools")
            given_steps = {k: v for k, v in steps.items() if v is not None}  # the tool demo's own defaults otherwise
            run_tools_demo(run_dir, seed=opts.seed, dtype=opts.dtype, **given_steps)
            return
        from ..experiments.demo import run_demo

        run_demo(opts.run_dir, seed=opts.seed, dtype=opts.dtype, **steps)
    except _user_errors() as exc:
        _fail(str(exc))
