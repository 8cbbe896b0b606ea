"""``grpolab eval``: accuracy, pass@k, maj@k and more of a model on a task or file."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import _fail, _quiet_hf, _user_errors, app


@app.command("eval")
def eval_cmd(
    model: str = typer.Option(
        ..., "--model", help="A Hugging Face model directory, a LoRA adapter directory, or embedded:tiny."
    ),
    data: str = typer.Option(
        ...,
        "--data",
        help="Questions: a JSONL file (GSM8K, MATH, plain, conversational), task:NAME (embedded) or rg:NAME "
             "(reasoning-gym).",
    ),
    prompt_template: Optional[str] = typer.Option(
        None,
        "--prompt-template",
        help="r1_zero, compact, question_only, chat, chat_r1 or a file; default: the tokenizer's chat template where "
             "it has one, else the task's, else r1_zero.",
    ),
    system_prompt: Optional[str] = typer.Option(
        None, "--system-prompt", help="Chat templates: a system message (text or a file)."
    ),
    reward: Optional[str] = typer.Option(
        None,
        "--reward",
        help="A reward name, 'pkg.mod:fn', or YAML: '{model: runs/rm/final}' (a reward model), a weighted list.",
    ),
    k: int = typer.Option(4, "--k", help="Samples per question (pass@k, maj@k, consistency)."),
    n: int = typer.Option(200, "--n", help="Questions to evaluate."),
    temperature: float = typer.Option(1.0, "--temperature"),
    max_tokens: int = typer.Option(
        1024,
        "--max-tokens",
        help="New tokens per sample at most. On a CPU with a real model the defaults (200 x 4 x 1024) take hours: try "
             "--n 20 --k 1 --max-tokens 256.",
    ),
    min_tokens: int = typer.Option(0, "--min-tokens", help="New tokens before a stop or eos may end a sample."),
    stop: Optional[list[str]] = typer.Option(
        None,
        "--stop",
        help="A stop string, kept in the output (repeat for several; default </answer>; --stop '' for none).",
    ),
    dtype: str = typer.Option(
        "float32", "--dtype", help="float32, or bfloat16 (autocast over fp32 weights, as training)."
    ),
    task_option: Optional[list[str]] = typer.Option(
        None, "--task-option", help="KEY=VALUE of an embedded task (repeat), e.g. --task-option digits=2."
    ),
    entropy: bool = typer.Option(
        True, "--entropy/--no-entropy", help="Also report the mean token entropy (a second pass over every response)."
    ),
    corpus: Optional[str] = typer.Option(None, "--corpus", help="Text/JSONL file or hf:NAME for perplexity."),
    out: Path = typer.Option(Path("runs/eval"), "--out", help="Where eval.json and generations.jsonl go."),
    seed: int = typer.Option(0, "--seed"),
    reward_timeout: float = typer.Option(10.0, "--reward-timeout", help="Seconds a reward may take per response."),
    backend: str = typer.Option("hf", "--backend", help="Sampler: hf (the model itself) or vllm (a vLLM engine)."),
    env: Optional[Path] = typer.Option(
        None, "--env", help="A YAML of tool-environment keys (as a config's env:): multi-turn tool use."
    ),
    rag_corpus: Optional[str] = typer.Option(
        None,
        "--rag-corpus",
        help="Retrieval-augmented prompts: the corpus (JSONL or .txt directory) whose top passages fill the template's "
             "{context}.",
    ),
    rag_top_k: int = typer.Option(1, "--rag-top-k", help="Passages per question with --rag-corpus."),
) -> None:
    """Evaluate a model: accuracy, format rate, pass@k, maj@k, consistency, diversity, perplexity.
    Prints the planned number of sampled tokens and a rough time before sampling."""
    _quiet_hf()
    from ..eval.report import check_writable, corpus_token_ids, evaluate_model, format_table, write_report
    from ..models import load_model, load_tokenizer, resolve_dtype
    from ..rollout import make_backend
    from ..training.inputs import task_or_file

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
        metrics, generations = evaluate_model(
            lm,
            tok,
            sampler,
            examples,
            template,
            reward_fn,
            k=k,
            temperature=temperature,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop=stops,
            seed=seed,
            corpus_ids=corpus_ids,
            reward_timeout_s=reward_timeout,
            source=data,
            entropy=entropy,
        )
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
    ctx = (
        torch.autocast(ids.device.type, dtype=autocast)
        if autocast is not None
        else torch.autocast("cpu", enabled=False)
    )
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


def _env_backend(sampler, path: Path, tokenizer):
    """``sampler`` wrapped in the tool environment described by the YAML file ``path``."""
    from ..envs import EnvBackend, build_env, load_env_file

    return EnvBackend(sampler, build_env(**load_env_file(path), tokenizer=tokenizer))
