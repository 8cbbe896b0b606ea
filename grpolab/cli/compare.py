"""``grpolab compare`` and ``grpolab demo``: the studies of ``grpolab.experiments``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import _fail, _quiet_hf, _user_errors, app


@app.command()
def compare(
    run_dir: Path = typer.Option(Path("runs/compare"), "--run-dir", help="Where report.md/.json/.png go."),
    seed: int = typer.Option(0, "--seed"),
    steps: Optional[int] = typer.Option(
        None,
        "--steps",
        help="Budget in RL steps of 128 responses (default 100; 60 with --variants; 4 of 32 with --variants --model).",
    ),
    k: int = typer.Option(4, "--k", help="Samples per held-out question."),
    test_examples: Optional[int] = typer.Option(
        None, "--test-examples", help="Held-out questions (default 200; 50 with --model)."
    ),
    ei: bool = typer.Option(False, "--ei", help="Also run expert iteration."),
    warm_steps: Optional[int] = typer.Option(None, "--warm-steps", help="Override the warm-start SFT length."),
    variants: Optional[str] = typer.Option(
        None, "--variants", help="GRPO variants side by side, e.g. grpo,dr_grpo,dapo,gspo,cispo,rloo."
    ),
    seeds: int = typer.Option(3, "--seeds", help="With --variants: seeds (warm starts) per variant."),
    model: Optional[str] = typer.Option(
        None,
        "--model",
        help="With --variants: a local chat model directory instead of the embedded model (no warm start).",
    ),
    data: Optional[str] = typer.Option(
        None,
        "--data",
        help="With --variants: a reasoning-gym dataset (rg:NAME) instead of the arithmetic task (no warm start).",
    ),
    backend: str = typer.Option("hf", "--backend", help="Sampler for the held-out evaluations: hf or vllm."),
    env: Optional[Path] = typer.Option(
        None, "--env", help="A YAML of tool-environment keys: evaluations sample through it, GRPO trains with it."
    ),
) -> None:
    """MLE vs PPO vs GRPO (and optionally expert iteration) from one warm start, equal sample budgets;
    or, with --variants, GRPO variants over several seeds."""
    _quiet_hf()
    try:
        if steps is not None and steps < 1:
            raise ValueError(f"--steps must be at least 1, got {steps}")
        if test_examples is not None and test_examples < 1:
            raise ValueError(f"--test-examples must be at least 1, got {test_examples}")
        if variants is not None:
            from ..experiments.presets import REAL_VARIANTS_STEPS, VARIANTS_STEPS, VARIANTS_WARM_STEPS
            from ..experiments.variants import parse_variants, run_variants
            from ..models.loading import model_directory

            if seeds < 1:
                raise ValueError(f"--seeds must be at least 1, got {seeds}")
            if env is not None:
                raise ValueError("--env applies to the method comparison (MLE/PPO/GRPO), not to --variants")
            if model is not None:
                model = str(model_directory(model))  # a bad directory is one line before anything trains
            run_variants(
                run_dir,
                parse_variants(variants),
                seeds=seeds,
                steps=steps or (REAL_VARIANTS_STEPS if model else VARIANTS_STEPS),
                warm_steps=warm_steps if warm_steps is not None else (0 if model or data else VARIANTS_WARM_STEPS),
                test_examples=test_examples or (50 if model else 200),
                model=model,
                data=data,
            )
            return
        if model is not None or data is not None:
            raise ValueError("--model and --data apply to --variants (the method comparison's MLE needs the embedded "
                             "task's worked solutions)")
        from ..envs import load_env_file
        from ..experiments.compare import run_compare

        if backend not in ("hf", "vllm"):
            raise ValueError(f"--backend must be hf or vllm, got {backend!r}")
        env_options = load_env_file(env) if env is not None else None  # checked before any training
        run_compare(run_dir, seed=seed, steps=steps or 100, k=k, test_examples=test_examples or 200, include_ei=ei,
                    warm_steps=warm_steps, backend=backend, env=env_options)
    except _user_errors() as exc:
        _fail(str(exc))


@app.command()
def demo(
    run_dir: Path = typer.Option(Path("runs/demo"), "--run-dir", help="Where the demo writes everything."),
    seed: int = typer.Option(0, "--seed"),
    sft_steps: Optional[int] = typer.Option(None, "--sft-steps", help="Override the SFT warm-up length."),
    grpo_steps: Optional[int] = typer.Option(None, "--grpo-steps", help="Override the number of GRPO steps."),
    test_examples: Optional[int] = typer.Option(None, "--test-examples", help="Held-out questions to evaluate on."),
    tools: bool = typer.Option(False, "--tools", help="The tool-use demo: questions answered by searching a corpus."),
    dtype: str = typer.Option("float32", "--dtype", help="Training numerics: float32 or bfloat16 (autocast)."),
) -> None:
    """The main job: SFT warm-up on imperfect demonstrations, then GRPO, on the embedded tiny model;
    prints a before/after table and writes metrics, a plot, summary.json and the final model.
    With --tools: the same on questions about invented entities, with a live BM25 search tool."""
    _quiet_hf()
    try:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
        if tools:
            from ..experiments.demo_tools import run_tools_demo

            overrides = {k: v for k, v in (("sft_steps", sft_steps), ("grpo_steps", grpo_steps),
                                           ("test_examples", test_examples)) if v is not None}
            run_tools_demo(run_dir if run_dir != Path("runs/demo") else Path("runs/demo_tools"), seed=seed, dtype=dtype,
                           **overrides)
            return
        from ..experiments.demo import run_demo

        run_demo(
            run_dir, seed=seed, sft_steps=sft_steps, grpo_steps=grpo_steps, test_examples=test_examples, dtype=dtype
        )
    except _user_errors() as exc:
        _fail(str(exc))
