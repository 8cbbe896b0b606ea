"""grpolab command line: ``grpolab demo``, ``grpolab grpo``, ``grpolab sft``.

Every training command takes ``--config FILE.yaml`` and any config field as ``--field value``
(dashes or underscores), e.g. ``grpolab grpo --config configs/grpo_tiny.yaml --n-grpo-steps 20``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

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


def _fail(message: str) -> None:
    typer.echo(f"grpolab: error: {message}", err=True)
    raise typer.Exit(2)


def _user_errors():
    from .algorithms.config import ConfigError
    from .data import DataError, TemplateError

    return (ConfigError, DataError, TemplateError, ValueError, FileNotFoundError, NotADirectoryError,
            IsADirectoryError, PermissionError)


def _trainers():
    """The front door: each training command, its config class and its trainer function."""
    from .algorithms.dpo import DPOConfig, train_dpo
    from .algorithms.expert_iteration import EIConfig, train_expert_iteration
    from .algorithms.grpo import GRPOConfig, train_grpo
    from .algorithms.ppo import PPOConfig, train_ppo
    from .algorithms.rm import RMConfig, train_rm
    from .algorithms.sft import SFTConfig, train_sft

    return {
        "grpo": (GRPOConfig, train_grpo),
        "sft": (SFTConfig, train_sft),
        "ei": (EIConfig, train_expert_iteration),
        "ppo": (PPOConfig, train_ppo),
        "dpo": (DPOConfig, train_dpo),
        "rm": (RMConfig, train_rm),
    }


def _build(config_cls, config: Optional[Path], args: list[str], resume: Optional[Path]):
    """The config of a fresh run (``--config`` + ``--field value``), or of a resumed one: the run's
    own saved config, with only the fields a resume may change taken from the command line."""
    from .algorithms.config import parse_overrides

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
    from .algorithms.run import RunInterrupted

    _quiet_hf()
    config_cls, train = _trainers()[command]
    try:
        cfg = _build(config_cls, config, list(ctx.args), resume)
        from .algorithms.preflight import check_imports

        check_imports(cfg)  # a reward/tool module that hangs or exits at import: one line, nothing touched
    except _user_errors() as exc:
        _fail(str(exc))
    try:
        return train(cfg, resume=resume is not None, overwrite=overwrite)
    except RunInterrupted as exc:
        typer.echo(f"grpolab: {exc}", err=True)
        raise typer.Exit(130)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, but say where the run can continue from
        from .algorithms.checkpoints import CheckpointManager

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
    typer.echo(f"run directory: {result.run_dir}\nfinal model:   {result.final_dir}\nmetrics:       {result.metrics_path}")
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


# command -> (help, how its result is reported); the trainer of each is in _trainers() above
TRAINING_COMMANDS = {
    "grpo": ("Train with GRPO (CS336 Algorithm 3). Any config field can follow as --field value.", _report),
    "sft": ("Supervised fine-tuning on (prompt, response) pairs, loss on the response only.", _report_sft),
    "ei": ("Expert iteration (CS336 Algorithm 2): sample, keep verified-correct responses, SFT on them.", _report_ei),
    "ppo": ("PPO with a value head and GAE (the RLHF baseline GRPO is measured against).", _report),
    "dpo": ("DPO on preference pairs; reports held-out preference accuracy.", _report_dpo),
    "rm": ("Train a reward model (Bradley-Terry) on preference pairs; reports held-out pairwise accuracy.", _report_rm),
}


def _add_training_command(name: str, help_text: str, report) -> None:
    def command(ctx: typer.Context, config: Optional[Path] = CONFIG_OPT, resume: Optional[Path] = RESUME_OPT,
                overwrite: bool = OVERWRITE_OPT) -> None:
        report(_train(name, ctx, config, resume, overwrite))

    app.command(name, context_settings=EXTRA, help=help_text)(command)


for _name, (_help, _reporter) in TRAINING_COMMANDS.items():
    _add_training_command(_name, _help, _reporter)


@app.command("eval")
def eval_cmd(
    model: str = typer.Option(..., "--model", help="A Hugging Face model directory, a LoRA adapter directory, or embedded:tiny."),
    data: str = typer.Option(..., "--data", help="Questions: a JSONL file (GSM8K, MATH, plain, conversational), task:NAME (embedded) or rg:NAME (reasoning-gym)."),
    prompt_template: Optional[str] = typer.Option(None, "--prompt-template", help="r1_zero, compact, question_only, chat, chat_r1 or a file; default: the tokenizer's chat template where it has one, else the task's, else r1_zero."),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="Chat templates: a system message (text or a file)."),
    reward: Optional[str] = typer.Option(None, "--reward", help="A reward name, 'pkg.mod:fn', or YAML: '{model: runs/rm/final}' (a reward model), a weighted list."),
    k: int = typer.Option(4, "--k", help="Samples per question (pass@k, maj@k, consistency)."),
    n: int = typer.Option(200, "--n", help="Questions to evaluate."),
    temperature: float = typer.Option(1.0, "--temperature"),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="New tokens per sample at most. On a CPU with a real model the defaults (200 x 4 x 1024) take hours: try --n 20 --k 1 --max-tokens 256."),
    min_tokens: int = typer.Option(0, "--min-tokens", help="New tokens before a stop or eos may end a sample."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="A stop string, kept in the output (repeat for several; default </answer>; --stop '' for none)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, or bfloat16 (autocast over fp32 weights, as training)."),
    task_option: Optional[list[str]] = typer.Option(None, "--task-option", help="KEY=VALUE of an embedded task (repeat), e.g. --task-option digits=2."),
    entropy: bool = typer.Option(True, "--entropy/--no-entropy", help="Also report the mean token entropy (a second pass over every response)."),
    corpus: Optional[str] = typer.Option(None, "--corpus", help="Text/JSONL file or hf:NAME for perplexity."),
    out: Path = typer.Option(Path("runs/eval"), "--out", help="Where eval.json and generations.jsonl go."),
    seed: int = typer.Option(0, "--seed"),
    reward_timeout: float = typer.Option(10.0, "--reward-timeout", help="Seconds a reward may take per response."),
    backend: str = typer.Option("hf", "--backend", help="Sampler: hf (the model itself) or vllm (a vLLM engine)."),
    env: Optional[Path] = typer.Option(None, "--env", help="A YAML of tool-environment keys (as a config's env:): multi-turn tool use."),
    rag_corpus: Optional[str] = typer.Option(None, "--rag-corpus", help="Retrieval-augmented prompts: the corpus (JSONL or .txt directory) whose top passages fill the template's {context}."),
    rag_top_k: int = typer.Option(1, "--rag-top-k", help="Passages per question with --rag-corpus."),
) -> None:
    """Evaluate a model: accuracy, format rate, pass@k, maj@k, consistency, diversity, perplexity.
    Prints the planned number of sampled tokens and a rough time before sampling."""
    _quiet_hf()
    from .algorithms.inputs import task_or_file
    from .eval.report import check_writable, corpus_token_ids, evaluate_model, format_table, write_report
    from .models import load_model, load_tokenizer, resolve_dtype
    from .rollout import make_backend

    try:
        if n < 1:
            raise ValueError(f"--n (questions to evaluate) must be at least 1, got {n}")
        if backend not in ("hf", "vllm"):
            raise ValueError(f"--backend must be hf or vllm, got {backend!r}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
        if min_tokens < 0 or min_tokens > max_tokens:
            raise ValueError(f"--min-tokens must be within [0, --max-tokens ({max_tokens})], got {min_tokens}")
        options = _key_values(task_option or [], "--task-option")
        if options and not data.startswith(("task:", "rg:")):
            raise ValueError("--task-option applies to a generated task (--data task:NAME or rg:NAME)")
        stops = ["</answer>"] if stop is None else [s for s in stop if s]
        check_writable(out)  # before any sampling: an unwritable --out must not cost the run
        retrieval = {"corpus": rag_corpus, "top_k": rag_top_k} if rag_corpus is not None else None
        tok = load_tokenizer(model)  # first: it renders chat prompts, and a bad path fails before the weights load
        if reward is not None and reward.lstrip().startswith(("{", "[")):  # a reward model or a weighted list
            reward = _key_values([f"reward={reward}"], "--reward")["reward"]
        examples, template, reward_fn = task_or_file(data, n, seed=seed, prompt_template=prompt_template, reward=reward,
                                                     retrieval=retrieval, task_options=options, tokenizer=tok,
                                                     system_prompt=system_prompt)
        lm = load_model(model, tokenizer=tok)
        corpus_ids = corpus_token_ids(corpus, tok) if corpus else None
        autocast = resolve_dtype(dtype) if dtype != "float32" else None
        sampler = make_backend(backend, lm, tok, seed=seed, autocast_dtype=autocast,
                               **({"dtype": dtype} if backend == "vllm" else {}))
        if env is not None:  # multi-turn: the tools run around the same sampler
            sampler = _env_backend(sampler, env, tok)
        typer.echo(_eval_plan(lm, len(examples), k, max_tokens, autocast), err=True)
        metrics, generations = evaluate_model(lm, tok, sampler, examples, template, reward_fn,
                                              k=k, temperature=temperature, max_tokens=max_tokens, min_tokens=min_tokens,
                                              stop=stops, seed=seed, corpus_ids=corpus_ids, reward_timeout_s=reward_timeout,
                                              source=data, entropy=entropy)
        sampler.close()
    except _user_errors() as exc:
        _fail(str(exc))
    write_report(out, metrics, generations)
    typer.echo(format_table(metrics))
    typer.echo(f"\nwritten: {out / 'eval.json'}, {out / 'generations.jsonl'}")


def _key_values(items: list[str], flag: str) -> dict:
    """``KEY=VALUE`` strings -> dict, values read as YAML scalars (2 -> int, true -> bool)."""
    import yaml

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def _eval_plan(model, questions: int, k: int, max_tokens: int, autocast) -> str:
    """One line before sampling: the most tokens it may sample and a rough time, from one timed
    decode-sized forward of the model (a batch of one new token per row, over no cache: a lower
    bound per step, so the estimate is rough and usually low for long responses)."""
    import time

    import torch

    rows = questions * k
    batch = min(rows, 64)
    total = rows * max_tokens
    ids = torch.zeros((batch, 1), dtype=torch.long, device=next(model.parameters()).device)
    ctx = torch.autocast(ids.device.type, dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    with torch.inference_mode(), ctx:
        model(ids)  # warm-up
        t0 = time.perf_counter()
        model(ids)
        step = time.perf_counter() - t0
    seconds = step * max_tokens * -(-rows // batch)
    when = f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
    return (f"grpolab eval: {questions} questions x {k} samples x up to {max_tokens} new tokens = up to {total:,} sampled "
            f"tokens; roughly {when} or more if every sample runs to the limit (--n, --k, --max-tokens make it smaller)")


def _env_backend(sampler, path: Path, tokenizer):
    """``sampler`` wrapped in the tool environment described by the YAML file ``path``."""
    from .envs import EnvBackend, build_env, load_env_file

    return EnvBackend(sampler, build_env(**load_env_file(path), tokenizer=tokenizer))


@app.command()
def compare(
    run_dir: Path = typer.Option(Path("runs/compare"), "--run-dir", help="Where report.md/.json/.png go."),
    seed: int = typer.Option(0, "--seed"),
    steps: Optional[int] = typer.Option(None, "--steps", help="Budget in RL steps of 128 responses (default 100; 60 with --variants; 4 of 32 with --variants --model)."),
    k: int = typer.Option(4, "--k", help="Samples per held-out question."),
    test_examples: Optional[int] = typer.Option(None, "--test-examples", help="Held-out questions (default 200; 50 with --model)."),
    ei: bool = typer.Option(False, "--ei", help="Also run expert iteration."),
    warm_steps: Optional[int] = typer.Option(None, "--warm-steps", help="Override the warm-start SFT length."),
    variants: Optional[str] = typer.Option(None, "--variants", help="GRPO variants side by side, e.g. grpo,dr_grpo,dapo,gspo,cispo,rloo."),
    seeds: int = typer.Option(3, "--seeds", help="With --variants: seeds (warm starts) per variant."),
    model: Optional[str] = typer.Option(None, "--model", help="With --variants: a local chat model directory instead of the embedded model (no warm start)."),
    data: Optional[str] = typer.Option(None, "--data", help="With --variants: a reasoning-gym dataset (rg:NAME) instead of the arithmetic task (no warm start)."),
    backend: str = typer.Option("hf", "--backend", help="Sampler for the held-out evaluations: hf or vllm."),
    env: Optional[Path] = typer.Option(None, "--env", help="A YAML of tool-environment keys: evaluations sample through it, GRPO trains with it."),
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
            from .models.loading import model_directory
            from .presets import REAL_VARIANTS_STEPS, VARIANTS_STEPS, VARIANTS_WARM_STEPS
            from .variants import parse_variants, run_variants

            if seeds < 1:
                raise ValueError(f"--seeds must be at least 1, got {seeds}")
            if env is not None:
                raise ValueError("--env applies to the method comparison (MLE/PPO/GRPO), not to --variants")
            if model is not None:
                model = str(model_directory(model))  # a bad directory is one line before anything trains
            run_variants(run_dir, parse_variants(variants), seeds=seeds,
                         steps=steps or (REAL_VARIANTS_STEPS if model else VARIANTS_STEPS),
                         warm_steps=warm_steps if warm_steps is not None else (0 if model or data else VARIANTS_WARM_STEPS),
                         test_examples=test_examples or (50 if model else 200), model=model, data=data)
            return
        if model is not None or data is not None:
            raise ValueError("--model and --data apply to --variants (the method comparison's MLE needs the embedded "
                             "task's worked solutions)")
        from .compare import run_compare
        from .envs import load_env_file

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
            from .demo_tools import run_tools_demo

            overrides = {k: v for k, v in (("sft_steps", sft_steps), ("grpo_steps", grpo_steps),
                                           ("test_examples", test_examples)) if v is not None}
            run_tools_demo(run_dir if run_dir != Path("runs/demo") else Path("runs/demo_tools"), seed=seed, dtype=dtype,
                           **overrides)
            return
        from .demo import run_demo

        run_demo(run_dir, seed=seed, sft_steps=sft_steps, grpo_steps=grpo_steps, test_examples=test_examples, dtype=dtype)
    except _user_errors() as exc:
        _fail(str(exc))


@app.command()
def view(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories (each with metrics.jsonl); later ones are overlaid."),
    out: Optional[Path] = typer.Option(None, "--out", help="The HTML file (default: view.html in the first run directory)."),
    serve: bool = typer.Option(False, "--serve", help="Serve the page on 127.0.0.1 (rebuilt at each load) instead."),
    port: int = typer.Option(8000, "--port", help="With --serve: the port (0: any free one)."),
) -> None:
    """A run's curves, config and per-token records (tokens.jsonl) in one self-contained HTML page."""
    from .viewer import make_server, render, write_report

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
    config: Path = typer.Option(..., "--config", "-c", help="Any trainer's YAML config; --field value overrides follow."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs (one rank each); without it: this machine's CPU and memory."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", help="Memory of each GPU in GiB (e.g. 80)."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="On the CPU: processes (torchrun --nproc_per_node)."),
    method: Optional[str] = typer.Option(None, "--method", help="grpo, sft, ei, ppo or dpo (default: from the config's steps key)."),
    architecture: Optional[str] = typer.Option(None, "--architecture", help="A named model shape (Qwen2.5-Math-1.5B, Qwen2.5-Math-7B) instead of the model's config.json."),
    prompt_tokens: Optional[int] = typer.Option(None, "--prompt-tokens", help="Prompt length (default: the longest training prompt, where the data is here)."),
) -> None:
    """Per-rank memory of a run (weights, gradients, AdamW, activations, log-prob buffers, reference,
    vLLM) from its config and the model's config.json, whether it fits, and the largest micro-batch."""
    _quiet_hf()
    from .algorithms.config import parse_overrides
    from .algorithms.memory_plan import Hardware, config_for_plan, estimate, format_plan

    try:
        cfg = config_for_plan(_trainers(), config, parse_overrides(list(ctx.args)), method)
        hw = Hardware.detect(gpus, gpu_memory, nproc)
        typer.echo(format_plan(estimate(cfg, hw, architecture, prompt_tokens), cfg))
    except _user_errors() as exc:
        _fail(str(exc))


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
    """The ``grpolab`` command (``boolean_flag_values``, then the typer app)."""
    import sys

    app(args=boolean_flag_values(sys.argv[1:]), prog_name="grpolab")


if __name__ == "__main__":  # pragma: no cover
    main()
