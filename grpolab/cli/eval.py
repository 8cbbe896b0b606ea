"""``grpolab eval``: accuracy, pass@k, maj@k and more of a model on a task or file."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import typer

from .base import _fail, _quiet_hf, _user_errors, app
from .fields import typer_options

# every option's flag, default and help are its field's in ``options.EvalOptions`` (read from the snapshot)
option = typer_options("eval")
NO_VERIFIER = ("grpolab eval: no accuracy, pass@k or maj@k: the reward is a reward model's score alone (reported as "
               "reward_model/<name>), not a check of the answer; add the task's verifier to the --reward list, e.g. "
               "'[{model: DIR}, {fn: arithmetic, key: answer_reward, weight: 0}]'")


@app.command("eval")
def eval_cmd(
    model: str = option("model"),
    data: str = option("data"),
    prompt_template: Optional[str] = option("prompt_template"),
    system_prompt: Optional[str] = option("system_prompt"),
    reward: Optional[str] = option("reward"),
    k: int = option("k"),
    n: Optional[int] = option("n"),
    temperature: float = option("temperature"),
    top_p: float = option("top_p"),
    max_tokens: int = option("max_tokens"),
    min_tokens: int = option("min_tokens"),
    stop: Optional[list[str]] = option("stop"),
    dtype: str = option("dtype"),
    task_options: Optional[list[str]] = option("task_options"),
    entropy: bool = option("entropy"),
    corpus: Optional[str] = option("corpus"),
    out: Path = option("out"),
    seed: int = option("seed"),
    reward_timeout_s: float = option("reward_timeout_s"),
    backend: str = option("backend"),
    env: Optional[Path] = option("env"),
    rag_corpus: Optional[str] = option("rag_corpus"),
    rag_top_k: int = option("rag_top_k"),
) -> None:
    """Evaluate a model: accuracy, format rate, pass@k, maj@k, consistency, diversity, perplexity.
    Prints the planned number of sampled tokens and a rough time before sampling."""
    given = dict(locals())  # the parameters, by name: EvalOptions validates them (each rule once)
    _quiet_hf()
    from ..eval.report import check_writable, corpus_token_ids, evaluate_model, format_table, write_report
    from ..models import load_model, load_tokenizer, resolve_dtype
    from ..rewards.reward_model import load_reward_models
    from ..rollout import make_backend
    from ..training.inputs import task_or_file
    from .options import EvalOptions

    try:
        opts = EvalOptions.from_cli(given)
        check_writable(opts.out)  # before any sampling: an unwritable --out must not cost the run
        tok = load_tokenizer(opts.model)  # first: it renders chat prompts, and a bad path fails before the weights
        prompt_template, system_prompt = eval_template(opts, tok)
        examples, template, reward_fn = task_or_file(
            opts.data, opts.n, seed=opts.seed, prompt_template=prompt_template, reward=opts.reward,
            retrieval=opts.retrieval, task_options=opts.task_options, tokenizer=tok, system_prompt=system_prompt)
        lm = load_model(opts.model, tokenizer=tok)
        load_reward_models(reward_fn)  # before sampling: a bad reward model must not cost the samples
        corpus_ids = corpus_token_ids(opts.corpus, tok) if opts.corpus else None
        dtype = opts.dtype if opts.dtype != "auto" else "bfloat16" if opts.backend == "vllm" else "float32"
        autocast = resolve_dtype(dtype) if dtype != "float32" else None
        sampler = make_backend(opts.backend, lm, tok, seed=opts.seed, autocast_dtype=autocast,
                               **({"dtype": dtype} if opts.backend == "vllm" else {}))
        if opts.env is not None:  # multi-turn: the tools run around the same sampler
            sampler = _env_backend(sampler, opts.env, tok, template)
        typer.echo(_eval_plan(lm, len(examples), opts.k, opts.max_tokens, autocast), err=True)
        metrics, generations = evaluate_model(
            lm, tok, sampler, examples, template, reward_fn, k=opts.k, temperature=opts.temperature, top_p=opts.top_p,
            max_tokens=opts.max_tokens, min_tokens=opts.min_tokens, stop=opts.stop, seed=opts.seed,
            corpus_ids=corpus_ids, reward_timeout_s=opts.reward_timeout_s, source=opts.data, entropy=opts.entropy)
        sampler.close()
        typer.echo(format_table(metrics))  # first: a report that cannot be written leaves the figures on screen
        if "accuracy" not in metrics:
            typer.echo(NO_VERIFIER, err=True)
        write_report(opts.out, metrics, generations)
    except _user_errors() as exc:
        _fail(str(exc))
    typer.echo(f"\nwritten: {opts.out / 'eval.json'}, {opts.out / 'generations.jsonl'}")


def trained_run_config(model: str) -> tuple[Path, dict] | None:
    """The config.yaml of the grpolab run whose ``final/`` (or ``checkpoints/step_N/``) ``model`` is, as a
    mapping; None for any other model."""
    from ..training.config import load_yaml_file
    from ..training.run_dir import CONFIG_FILE

    path = Path(model)
    for run in (path.parent, path.parent.parent) if path.is_dir() else ():
        if (run / CONFIG_FILE).is_file() and (path.name == "final" or path.parent.name == "checkpoints"):
            config = load_yaml_file(run / CONFIG_FILE)
            return (run / CONFIG_FILE, config) if isinstance(config, dict) else None
    return None


def eval_template(opts, tokenizer) -> tuple[str | None, str | None]:
    """The prompt template (and system prompt) of an evaluation, said in one line on stderr with why:
    --prompt-template; else the one the model was trained with (a grpolab run's model: the template its
    config.yaml names, or the one that run chose for itself); else the task's own (task:NAME, rg:NAME);
    else r1_zero. Never chosen by whether the tokenizer has a chat template."""
    from ..data import get_task

    name, system_prompt, why = opts.prompt_template, opts.system_prompt, "--prompt-template"
    run = trained_run_config(opts.model) if name is None else None
    if run is not None:
        path, config = run
        name = config.get("prompt_template")
        if name is None:  # the run chose its own default: the same rules again, unsaid
            name = _trained_default(config, tokenizer)
        system_prompt = system_prompt if system_prompt is not None else config.get("system_prompt")
        why = f"the template {opts.model} was trained with, from {path}"
    elif name is None and opts.data.startswith("vf:"):
        return None, system_prompt  # a verifiers environment's chat prompts, as training renders them (said there)
    elif name is None and opts.data.startswith(("task:", "rg:")):
        name = get_task(opts.data.removeprefix("task:"), seed=opts.seed, options=opts.task_options).default_template
        why = f"{opts.data}'s own; --prompt-template chooses another"
    elif name is None:
        name, why = "r1_zero", "the default (CS336's); --prompt-template chooses another"
    typer.echo(f"grpolab eval: prompt template {name} ({why})", err=True)
    return name, system_prompt


def _trained_default(config: dict, tokenizer) -> str:
    """The template a run whose config names none trained with: the one its SFT pairs held
    (``load_sft_inputs``), else its default (``default_template_name``)."""
    from ..data import load_sft_pairs
    from ..data.prompts import held_template
    from ..training.inputs import default_template_name, looks_like_sft_pairs, run_task

    data = config.get("train_data")
    if data and Path(data).is_file() and looks_like_sft_pairs(data):
        held = held_template(p.prompt for p in load_sft_pairs(data) if p.messages is None)
        if held is not None:
            return held
    # the run's task as training built it (run_task): a verifiers environment's (env.verifiers) included,
    # whose rubric reads no <answer> tags (plain chat), as a task's or the default r1_zero reward does
    task = run_task(SimpleNamespace(env=config.get("env"), seed=config.get("seed", 0), task=config.get("task"),
                                    task_options=config.get("task_options")))
    return default_template_name(task, tokenizer, config.get("reward"), say=False)


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
    off = torch.autocast("cpu", enabled=False)
    ctx = torch.autocast(ids.device.type, dtype=autocast) if autocast is not None else off
    with torch.inference_mode(), ctx:
        model(ids)  # warm-up
        t0 = time.perf_counter()
        model(ids)
        step = time.perf_counter() - t0
    seconds = step * max_tokens * -(-rows // batch)
    when = f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
    return (
        f"grpolab eval: {questions} questions x {k} samples x up to {max_tokens} new tokens = up to {total:,} sampled "
        f"tokens; roughly {when} or more if every sample runs to the limit (--n, --k, --max-tokens make it smaller)"
    )


def _env_backend(sampler, path: Path, tokenizer, template=None):
    """``sampler`` wrapped in the tool environment described by the YAML file ``path`` (native function
    calling: the prompts ``template`` renders carry the tool schemas)."""
    from ..envs import EnvBackend, build_env, load_env_file
    from ..envs.vf import build_vf_env

    options = load_env_file(path)
    build = build_vf_env if options.get("verifiers") else build_env  # a verifiers environment's tools (vf: data)
    return EnvBackend(sampler, build(**options, tokenizer=tokenizer), template=template)
