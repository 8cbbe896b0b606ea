"""``grpolab demo --tools``: the embedded tiny model learns to answer questions about invented
entities by searching a corpus, and GRPO with the live search tool improves on its imperfect
demonstrations.

The task (``data/tasks/retrieval.py``) is built so that a 0.9M-parameter character-level model
can learn it in minutes: ``ruler of Tiva?`` -> ``<search>Tiva ruler</search>`` ->
``<result>Tiva ruler: Mokek</result>`` -> ``</think> <answer>Mokek</answer>``; names of a fixed
shape (4 and 5 letters), one corpus line per fact, top-1 search. The skill is copying: the entity
from the question into the query, the value from the result into the answer.

1. generate the task's world and corpus (``corpus.jsonl``) and index it (BM25, cached);
2. SFT on demonstrations of which ``wrong_fraction`` are imperfect (``wrong_kind="answer"``: the
   right search, then an invented name instead of the one in the result — the imperfection is
   in the answer, as the arithmetic demo's wrong final answers), replayed through the live tool,
   the loss on the model's tokens only (observations masked, as in the rollouts); a share of them
   is also shown as retrieval-augmented prompts (the passage in the prompt, the same answer, no
   call). The SFT loop is here because ``train_sft`` trains on whole solution strings and has no
   loss mask for observations; the model is saved in ``sft/final``;
3. evaluate on held-out entities three ways: no retrieval (the question alone), a
   retrieval-augmented prompt (the top passage for the question in ``{context}``), and tool use
   (multi-turn); every figure samples at temperature 1 with a fixed seed;
4. GRPO with the live tool: ``train_grpo`` with ``env`` set (``TOOLS_GRPO``: Dr. GRPO settings
   as the arithmetic demo — no std normalisation, a constant length normaliser), observation
   tokens masked out of the loss; its metrics (tool calls, turns, observation vs model tokens)
   and checkpoints are in ``grpo/``;
5. evaluate again; print the table and the share of answers that called the tool; write
   ``summary.json`` and ``final/``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

import torch

from .algorithms.checkpoints import atomic_write_text, save_final
from .algorithms.grpo import GRPOConfig, train_grpo
from .algorithms.metrics import read_metrics
from .algorithms.optimization import make_optimizer, make_scheduler
from .core import (
    build_sequences,
    get_response_log_probs,
    pad_token_id,
    sft_microbatch_train_step,
)
from .data import get_task, load_template
from .envs import (
    EnvBackend,
    RetrievalAugmentedTemplate,
    build_env,
    loss_mask_tensor,
    replay_demonstrations,
    tool_metrics,
)
from .eval import evaluate
from .models import load_model_and_tokenizer
from .rewards import RewardScorer
from .rollout import SamplingParams, make_backend

TOOLS_TASK_OPTIONS = {"num_entities": 1000, "relations": "ruler,river,mayor", "wrong_fraction": 0.5,
                      "wrong_kind": "answer"}
TOOLS_ENV = dict(top_k=1, max_chars=100, max_turns=2, max_total_tokens=96)
TOOLS_SFT = dict(steps=500, batch_size=32, learning_rate=3e-3, warmup_steps=15, train_examples=2000, rag_examples=500)
# GRPO with the live tool: 8 questions x 8 answers per step, one on-policy optimizer step
TOOLS_GRPO = dict(n_grpo_steps=60, rollout_batch_size=64, group_size=8, train_batch_size=64,
                  gradient_accumulation_steps=2, learning_rate=2e-4, warmup_steps=0, loss_type="reinforce_with_baseline",
                  use_std_normalization=False, length_normalization="masked_normalize", sampling_temperature=1.0,
                  sampling_min_tokens=1, sampling_max_tokens=40, prompt_template="compact", eval_examples=50,
                  log_generations_samples=0)
TOOLS_TEST_EXAMPLES = 200
# the retrieval-augmented prompt: the passage right before the answer is opened, a short copy
# distance (the builtin rag_compact puts it before the question)
RAG_TEMPLATE = "Q: {question}\nContext: {context}\nA: <think>"
MODES = (("no retrieval", "no_retrieval"), ("retrieval-augmented prompt", "rag"), ("tool use", "tools"))


def _masked_batch(prompt_ids, response_ids, loss_masks, pad_id):
    """Shifted sequences and the loss mask: response tokens the model wrote (observations out)."""
    batch = build_sequences(prompt_ids, response_ids, pad_id)
    mask = batch["response_mask"] & loss_mask_tensor([len(p) for p in prompt_ids], loss_masks, batch["labels"].shape)
    return batch, mask


def sft_demonstrations(env, tokenizer, train, rag_examples: int) -> list:
    """Every training question as a tool-using demonstration (compact prompt), and the first
    ``rag_examples`` also as a retrieval-augmented one (the top passage in the prompt, then the
    same answer, right or imperfect, with no call)."""
    compact, rag = load_template("compact"), RetrievalAugmentedTemplate(RAG_TEMPLATE, env.tools["search"])
    prompts = [compact.format(e.question) for e in train] + [rag.format(e.question) for e in train[:rag_examples]]
    solutions = [e.solution for e in train] + [e.solution[e.solution.index("</think>"):] for e in train[:rag_examples]]
    return replay_demonstrations(env, tokenizer, prompts, solutions)


def sft_on_demonstrations(model, tokenizer, demos, steps, batch_size, learning_rate, warmup_steps, seed) -> float:
    """Maximum likelihood on the model's tokens of replayed demonstrations; returns the last NLL."""
    optimizer = make_optimizer(model, learning_rate)
    scheduler = make_scheduler(optimizer, warmup_steps, steps, "cosine")
    rng, pad_id, nll = random.Random(seed), pad_token_id(tokenizer), float("nan")
    model.train()
    for _ in range(steps):
        rows = [demos[rng.randrange(len(demos))] for _ in range(batch_size)]
        batch, mask = _masked_batch([d.prompt_ids for d in rows], [d.response_ids for d in rows],
                                    [d.loss_mask for d in rows], pad_id)
        lp = get_response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]
        _, meta = sft_microbatch_train_step(lp, mask, 1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        nll = float(meta["token_nll"])
    return nll


def evaluate_modes(model, tokenizer, env, test, scorer, sampling, seed) -> dict[str, dict]:
    """Held-out accuracy without retrieval, with a retrieval-augmented prompt, and with the tool;
    the tool row also has the share of answers that called it."""
    compact = load_template("compact")
    rag = RetrievalAugmentedTemplate(RAG_TEMPLATE, env.tools["search"])
    out = {}
    for _, key in MODES:
        backend = make_backend("hf", model, tokenizer, generator=torch.Generator().manual_seed(seed))
        if key == "tools":
            backend, mode_sampling = EnvBackend(backend, env), sampling
        else:  # one turn writes the whole response, as long as a tool-use rollout may be
            mode_sampling = dataclasses.replace(sampling, max_tokens=env.max_total_tokens)
        result = evaluate(backend, test, rag if key == "rag" else compact, scorer.reward_fn, mode_sampling,
                          scorer=scorer)
        out[key] = {"accuracy": result.metrics["accuracy"], **tool_metrics(result.rollouts)}
    return out


def _table(before: dict, after: dict) -> str:
    lines = [f"{'held-out accuracy':30} {'SFT only':>10} {'SFT + GRPO':>11}"]
    for label, key in MODES:
        lines.append(f"{label:30} {before[key]['accuracy']:>10.1%} {after[key]['accuracy']:>11.1%}")
    lines.append(f"{'answers that called the tool':30} {before['tools']['tools/call_rate']:>10.1%} "
                 f"{after['tools']['tools/call_rate']:>11.1%}")
    return "\n".join(lines)


def run_tools_demo(run_dir: str | Path, seed: int = 0, sft_steps: int | None = None, grpo_steps: int | None = None,
                   test_examples: int | None = None, train_examples: int | None = None, size: str = "tiny",
                   log=print, show_progress: bool = True) -> dict:
    """The whole demo (module docstring); returns the summary written to ``summary.json``."""
    run_dir, start, timings = Path(run_dir), time.perf_counter(), {}
    run_dir.mkdir(parents=True, exist_ok=True)
    task = get_task("retrieval", seed=seed, **TOOLS_TASK_OPTIONS)
    corpus = task.write_corpus(run_dir / "corpus.jsonl")
    env_options = dict(tools=["search"], corpus=str(corpus), cache_dir=str(run_dir / "bm25"), **TOOLS_ENV)
    env = build_env(**env_options)
    model, tokenizer = load_model_and_tokenizer(f"embedded:{size}", seed=seed)
    train = task.examples("train", train_examples or TOOLS_SFT["train_examples"])
    test = task.examples("test", test_examples or TOOLS_TEST_EXAMPLES)
    demos = sft_demonstrations(env, tokenizer, train, TOOLS_SFT["rag_examples"])
    sft = {**TOOLS_SFT, "steps": sft_steps or TOOLS_SFT["steps"]}
    grpo = {**TOOLS_GRPO, "n_grpo_steps": grpo_steps or TOOLS_GRPO["n_grpo_steps"]}
    grpo_cfg = GRPOConfig(**grpo, task="retrieval", task_options=TOOLS_TASK_OPTIONS, task_train_size=len(train),
                          env=env_options, seed=seed, device="cpu", show_progress=show_progress,
                          run_dir=str(run_dir / "grpo"))
    sampling = SamplingParams(temperature=1.0, max_tokens=grpo["sampling_max_tokens"], min_tokens=1, stop=["</answer>"])

    log(f"[1/4] SFT on {TOOLS_TASK_OPTIONS['wrong_fraction']:.0%}-imperfect tool-using demonstrations "
        f"({sft['steps']} steps)")
    t = time.perf_counter()
    nll = sft_on_demonstrations(model, tokenizer, demos, sft["steps"], sft["batch_size"], sft["learning_rate"],
                                sft["warmup_steps"], seed)
    timings["sft_s"] = time.perf_counter() - t
    sft_final = save_final(model, tokenizer, run_dir / "sft" / "final")
    with RewardScorer(task.reward_fn, timeout_s=10.0) as scorer:
        log(f"[2/4] evaluating the SFT model on {len(test)} held-out questions (no retrieval / RAG prompt / tool use)")
        t = time.perf_counter()
        before = evaluate_modes(model, tokenizer, env, test, scorer, sampling, seed + 12345)
        timings["eval_before_s"] = time.perf_counter() - t
        log(f"[3/4] GRPO with the live search tool ({grpo_cfg.n_grpo_steps} steps of "
            f"{grpo_cfg.rollout_batch_size // grpo_cfg.group_size} x {grpo_cfg.group_size} rollouts)")
        t = time.perf_counter()
        result = train_grpo(grpo_cfg, model=model, tokenizer=tokenizer, overwrite=True)
        timings["grpo_s"] = time.perf_counter() - t
        history = [{"step": r["grpo_step"], "reward": r["train/reward"], "call_rate": r["tools/call_rate"],
                    "model_tokens": r["tools/model_tokens"], "observation_tokens": r["tools/observation_tokens"]}
                   for r in read_metrics(result.metrics_path) if "train/reward" in r]
        log("[4/4] evaluating the GRPO model on the same questions")
        t = time.perf_counter()
        after = evaluate_modes(model, tokenizer, env, test, scorer, sampling, seed + 12345)
        timings["eval_after_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - start
    summary = {"task": "retrieval", "task_options": TOOLS_TASK_OPTIONS, "env": TOOLS_ENV, "sft": sft, "grpo": grpo,
               "seed": seed, "size": size, "test_examples": len(test), "sft_final_nll": nll, "before": before,
               "after": after, "grpo_history": history,
               "tool_accuracy_gain_points": round(100 * (after["tools"]["accuracy"] - before["tools"]["accuracy"]), 1),
               "wall_seconds": {k: round(v, 1) for k, v in timings.items()},
               "paths": {"corpus": str(corpus), "sft_final": str(sft_final), "grpo_metrics": str(result.metrics_path),
                         "final": str(save_final(model, tokenizer, run_dir / "final"))}}
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    log("\n" + _table(before, after))
    log(f"\ntool-use accuracy gain: {summary['tool_accuracy_gain_points']:+.1f} points   wall time: "
        f"{timings['total_s']:.0f} s (SFT {timings['sft_s']:.0f} s, GRPO {timings['grpo_s']:.0f} s)")
    return summary
