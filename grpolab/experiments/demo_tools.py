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
   call): ``train_sft`` with ``env`` set (``TOOLS_SFT``), its run (metrics, ``final/``) in ``sft/``;
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
import time
from pathlib import Path

import torch

from ..algorithms.grpo import GRPOConfig, train_grpo
from ..algorithms.sft import SFTConfig, train_sft
from ..data import SFTPair, get_task, load_template
from ..envs import (
    EnvBackend,
    RetrievalAugmentedTemplate,
    build_env,
    tool_metrics,
)
from ..eval import evaluate
from ..models import load_model_and_tokenizer
from ..rewards import RewardScorer
from ..rollout import SamplingParams, make_backend
from ..training.checkpoints import atomic_write_text, save_final
from ..training.health import UnhealthyRunError
from ..training.metric_logging import read_metrics
from .demo import NO_SIGNAL_STEPS, no_signal_line

TOOLS_TASK_OPTIONS = {"num_entities": 1000, "relations": "ruler,river,mayor", "wrong_fraction": 0.5,
                      "wrong_kind": "answer"}
TOOLS_ENV = dict(top_k=1, max_chars=100, max_turns=2, max_total_tokens=96)
# SFT on the replayed demonstrations (observations out of the loss): per-sequence summed NLL. Its
# length is chosen by validation: tool-use success on SFT_VALIDATION held-out validation questions
# (sampled through the live tool at temperature 1) is measured every SFT_CHECK_EVERY steps, and SFT
# stops at the first check that reaches SFT_TARGET, within a cap of n_sft_steps (a start that
# imitation leaves near 0 % gives GRPO groups with no right answer, hence no signal)
SFT_TARGET, SFT_CHECK_EVERY, SFT_VALIDATION = 0.15, 100, 100
TOOLS_SFT = dict(n_sft_steps=1500, train_batch_size=32, gradient_accumulation_steps=1, learning_rate=3e-3,
                 warmup_steps=15, lr_schedule="cosine", normalize_constant=1.0, task_train_size=2000,
                 prompt_template="compact", eval_examples=SFT_VALIDATION, eval_every=SFT_CHECK_EVERY,
                 stop_at_eval_accuracy=SFT_TARGET, log_generations_samples=0, sampling_max_tokens=40)
TOOLS_RAG_EXAMPLES = 500  # of the SFT questions also shown as retrieval-augmented prompts
# GRPO with the live tool: 8 questions x 8 answers per step, one on-policy optimizer step
TOOLS_GRPO = dict(n_grpo_steps=100, rollout_batch_size=64, group_size=8, train_batch_size=64,
                  gradient_accumulation_steps=2, learning_rate=2e-4, warmup_steps=0,
                  loss_type="reinforce_with_baseline", use_std_normalization=False,
                  length_normalization="masked_normalize", sampling_temperature=1.0, sampling_min_tokens=1,
                  sampling_max_tokens=40, prompt_template="compact", eval_examples=50, log_generations_samples=0)
TOOLS_TEST_EXAMPLES = 200
# the retrieval-augmented prompt: the passage right before the answer is opened, a short copy
# distance (the builtin rag_compact puts it before the question)
RAG_TEMPLATE = "Q: {question}\nContext: {context}\nA: <think>"
MODES = (("no retrieval", "no_retrieval"), ("retrieval-augmented prompt", "rag"), ("tool use", "tools"))


def demonstration_pairs(env, train, rag_examples: int) -> list[SFTPair]:
    """Every training question as a tool-using demonstration (compact prompt), and the first
    ``rag_examples`` also as a retrieval-augmented one (the top passage in the prompt, then the
    same answer, right or imperfect, with no call). ``train_sft`` with ``env`` replays the calls."""
    compact, rag = load_template("compact"), RetrievalAugmentedTemplate(RAG_TEMPLATE, env.tools["search"])
    return ([SFTPair(compact.format(e.question), e.solution, e.answer) for e in train]
            + [SFTPair(rag.format(e.question), e.solution[e.solution.index("</think>"):], e.answer)
               for e in train[:rag_examples]])


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
                   log=print, show_progress: bool = True, dtype: str = "float32") -> dict:
    """The whole demo (module docstring); returns the summary written to ``summary.json``."""
    run_dir, start, timings = Path(run_dir), time.perf_counter(), {}
    run_dir.mkdir(parents=True, exist_ok=True)
    task = get_task("retrieval", seed=seed, **TOOLS_TASK_OPTIONS)
    corpus = task.write_corpus(run_dir / "corpus.jsonl")
    env_options = dict(tools=["search"], corpus=str(corpus), cache_dir=str(run_dir / "bm25"), **TOOLS_ENV)
    env = build_env(**env_options)
    model, tokenizer = load_model_and_tokenizer(f"embedded:{size}", seed=seed)
    sft = {**TOOLS_SFT, "n_sft_steps": sft_steps or TOOLS_SFT["n_sft_steps"],
           "task_train_size": train_examples or TOOLS_SFT["task_train_size"]}
    train = task.examples("train", sft["task_train_size"])
    test = task.examples("test", test_examples or TOOLS_TEST_EXAMPLES)
    common = dict(task="retrieval", task_options=TOOLS_TASK_OPTIONS, env=env_options, seed=seed, device="cpu",
                  show_progress=show_progress, dtype=dtype)
    sft_cfg = SFTConfig(**sft, **common, run_dir=str(run_dir / "sft"))
    grpo = {**TOOLS_GRPO, "n_grpo_steps": grpo_steps or TOOLS_GRPO["n_grpo_steps"], "health_window": NO_SIGNAL_STEPS,
            "stop_on_unhealthy": ["zero_variance"]}
    grpo_cfg = GRPOConfig(**grpo, **common, task_train_size=len(train), run_dir=str(run_dir / "grpo"))
    sampling = SamplingParams(temperature=1.0, max_tokens=grpo["sampling_max_tokens"], min_tokens=1, stop=["</answer>"])

    log(f"[1/4] SFT on {TOOLS_TASK_OPTIONS['wrong_fraction']:.0%}-imperfect tool-using demonstrations "
        f"(until validation tool-use success reaches {SFT_TARGET:.0%}, checked every {SFT_CHECK_EVERY} steps; "
        f"at most {sft_cfg.n_sft_steps} steps)")
    t = time.perf_counter()
    sft_result = train_sft(sft_cfg, model=model, tokenizer=tokenizer, overwrite=True,
                           pairs=demonstration_pairs(env, train, TOOLS_RAG_EXAMPLES))
    timings["sft_s"] = time.perf_counter() - t
    sft_records = read_metrics(sft_result.metrics_path)
    nll = [r["train/token_nll"] for r in sft_records if "train/token_nll" in r][-1]
    sft_steps_run = max(r["train_step"] for r in sft_records if "train_step" in r) + 1
    sft_final = sft_result.final_dir
    with RewardScorer(task.reward_fn, timeout_s=10.0) as scorer:
        log(f"[2/4] evaluating the SFT model on {len(test)} held-out questions (no retrieval / RAG prompt / tool use)")
        t = time.perf_counter()
        before = evaluate_modes(model, tokenizer, env, test, scorer, sampling, seed + 12345)
        timings["eval_before_s"] = time.perf_counter() - t
        log(f"[3/4] GRPO with the live search tool ({grpo_cfg.n_grpo_steps} steps of "
            f"{grpo_cfg.rollout_batch_size // grpo_cfg.group_size} x {grpo_cfg.group_size} rollouts)")
        t, stopped = time.perf_counter(), None
        try:
            train_grpo(grpo_cfg, model=model, tokenizer=tokenizer, overwrite=True)
        except UnhealthyRunError:  # zero advantages left the weights as they were: the SFT figures stand
            stopped = no_signal_line("questions with the tool", before["tools"]["accuracy"],
                                     f"--sft-steps {2 * TOOLS_SFT['n_sft_steps']}")
            log(stopped)
        timings["grpo_s"] = time.perf_counter() - t
        metrics_path = Path(grpo_cfg.run_dir) / "metrics.jsonl"
        history = [{"step": r["grpo_step"], "reward": r["train/reward"], "call_rate": r["tools/call_rate"],
                    "model_tokens": r["tools/model_tokens"], "observation_tokens": r["tools/observation_tokens"]}
                   for r in read_metrics(metrics_path) if "train/reward" in r]
        t = time.perf_counter()
        if stopped is None:
            log("[4/4] evaluating the GRPO model on the same questions")
            after = evaluate_modes(model, tokenizer, env, test, scorer, sampling, seed + 12345)
        else:
            after = before
        timings["eval_after_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - start
    summary = {"task": "retrieval", "task_options": TOOLS_TASK_OPTIONS, "env": TOOLS_ENV, "sft": sft, "grpo": grpo,
               "seed": seed, "size": size, "dtype": dtype, "torch_threads": torch.get_num_threads(),
               "test_examples": len(test), "sft_final_nll": nll, "before": before, "after": after,
               "grpo_history": history, "grpo_stopped": stopped, "sft_steps_run": sft_steps_run,
               "tool_accuracy_gain_points": round(100 * (after["tools"]["accuracy"] - before["tools"]["accuracy"]), 1),
               "wall_seconds": {k: round(v, 1) for k, v in timings.items()},
               "paths": {"corpus": str(corpus), "sft_final": str(sft_final), "grpo_metrics": str(metrics_path),
                         "final": str(save_final(model, tokenizer, run_dir / "final"))}}
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    log("\n" + _table(before, after))
    log(f"\ntool-use accuracy gain: {summary['tool_accuracy_gain_points']:+.1f} points   wall time: "
        f"{timings['total_s']:.0f} s (SFT {timings['sft_s']:.0f} s, GRPO {timings['grpo_s']:.0f} s)")
    return summary
