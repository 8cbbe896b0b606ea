"""GRPO with a tool environment: observation tokens are context only — zero gradient through every
loss, normaliser, KL and IS term — and a run with the live tool logs its tool figures."""

import json
from contextlib import nullcontext

import pytest
import torch

from grpolab.algorithms.grpo import train_grpo
from grpolab.algorithms.grpo_update import accumulate_policy_gradient
from grpolab.rollout import Rollout
from grpolab.training.batching import make_rollout_batch

CPU = torch.device("cpu")
RATIO_FREE = ("no_baseline", "reinforce_with_baseline")


def _multi_turn_rollouts(tok, n=4):
    """A group of ``n`` tool-using responses: model tokens, an observation, model tokens again."""
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = enc("Q: 12+30\nA: ")
    out = []
    for i in range(n):
        call, obs, answer = (enc(f"<calculate>12+3{i}</calculate>"), enc(f"<result>4{i}</result>"),
                             enc(f"<answer>4{i}</answer>"))
        ids = call + obs + answer
        mask = [True] * len(call) + [False] * len(obs) + [True] * len(answer)
        out.append(Rollout(prompt="q", response="r", prompt_ids=prompt, response_ids=ids, logprobs=[-1.0] * len(ids),
                           finish_reason="stop", prompt_index=0, loss_mask=mask))
    return out


def _gradient(model, batch, cfg):
    model.zero_grad(set_to_none=True)
    rows = list(range(batch.labels.shape[0]))
    accumulate_policy_gradient(model, batch, rows, cfg, torch.ones(len(rows), dtype=torch.bool), 0.1, CPU, nullcontext)
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


@pytest.mark.parametrize(
    "loss_type,normalization,shared",
    [("grpo_clip", "masked_mean", True), ("grpo_clip", "masked_normalize", False), ("grpo_clip", "token_mean", True),
     ("grpo_clip", "masked_mean", False), ("no_baseline", "masked_mean", True),
     ("reinforce_with_baseline", "token_mean", False), ("grpo_no_clip", "masked_mean", True),
     ("gspo", "masked_mean", True), ("cispo", "token_mean", True), ("sapo", "masked_normalize", True)],
)
def test_observation_tokens_get_zero_gradient(grpo_config, tiny_model, loss_type, shared, normalization):
    model, tok = tiny_model()
    rollouts = _multi_turn_rollouts(tok)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    batch = make_rollout_batch(rollouts, rewards, rewards - 0.5, tok.pad_token_id)
    start = len(rollouts[0].prompt_ids) - 1
    expected = torch.zeros_like(batch.response_mask)
    expected[:, start : start + len(rollouts[0].loss_mask)] = torch.tensor(rollouts[0].loss_mask)
    assert torch.equal(batch.response_mask, expected)  # the loss mask: model tokens only
    # every per-token input of the loss present: old (clipped ratio), reference (KL), IS weights
    for key in ("old_log_probs", "ref_log_probs"):
        setattr(
            batch,
            key,
            batch.sampler_log_probs - 0.05 * torch.rand(batch.labels.shape, generator=torch.Generator().manual_seed(1)),
        )
    batch.is_weights = torch.full(batch.labels.shape, 0.9)
    cfg = grpo_config(rollout_batch_size=4, group_size=4, train_batch_size=4, gradient_accumulation_steps=2,
                      loss_type=loss_type, length_normalization=normalization, epochs_per_rollout_batch=2,
                      kl_coef=0.1, entropy_coef=0.01, share_prompt_prefix=shared)
    reference = _gradient(model, batch, cfg)
    assert reference.abs().sum() > 0
    observation = batch.response_mask.clone().zero_()
    observation[:, start : start + len(rollouts[0].loss_mask)] = ~torch.tensor(rollouts[0].loss_mask)
    for key in ("old_log_probs", "ref_log_probs", "is_weights", "sampler_log_probs"):
        original = getattr(batch, key).clone()
        getattr(batch, key)[observation] += 3.0  # change the loss's inputs at observation tokens only
        assert torch.equal(_gradient(model, batch, cfg), reference), key
        getattr(batch, key)[~observation & batch.response_mask] += 3.0  # ... and at model tokens: it moves
        # (the sampler's log-probs only enter through the IS weights; the losses without a ratio
        # never read the old log-probs)
        if key != "sampler_log_probs" and not (key == "old_log_probs" and loss_type in RATIO_FREE):
            assert not torch.equal(_gradient(model, batch, cfg), reference), key
        setattr(batch, key, original)


def test_grpo_with_the_calculator_tool_runs_and_logs_tool_figures(grpo_config):
    cfg = grpo_config(n_grpo_steps=2, sampling_max_tokens=16, env={"tools": ["calculate"], "max_turns": 2,
                                                                   "max_total_tokens": 40, "call_cost": 0.1})
    result = train_grpo(cfg)
    steps = [json.loads(line) for line in open(result.metrics_path) if '"train/reward"' in line]
    assert len(steps) == 2
    for record in steps:
        assert 0.0 <= record["tools/call_rate"] <= 1.0 and record["tools/model_tokens"] > 0
        assert record["tools/turns"] >= 1.0


def test_unknown_env_keys_and_a_missing_corpus_are_one_line_errors(grpo_config, tmp_path):
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.training.config import ConfigError

    with pytest.raises(ConfigError, match="'env': unknown key\\(s\\) korpus"):
        GRPOConfig.build(overrides={"env": {"tools": ["search"], "korpus": "x.jsonl"}})
    cfg = grpo_config(env={"tools": ["search"], "corpus": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ValueError, match="missing.jsonl"):
        train_grpo(cfg)


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_eval_with_an_env_file_reports_tool_use_and_bad_files_are_one_line_errors(tmp_path):
    from tests.training.test_run import Proc, grpolab

    env = tmp_path / "env.yaml"
    env.write_text("tools: [calculate]\nmax_turns: 2\nmax_total_tokens: 30\n")
    out = tmp_path / "out"
    Proc(grpolab("eval", "--model", "embedded:tiny", "--data", "task:arithmetic", "--n", "4", "--k", "2",
                 "--max-tokens", "12", "--out", out, "--env", env), tmp_path, "eval").ok()
    metrics = json.loads((out / "eval.json").read_text())
    generations = [json.loads(line) for line in open(out / "generations.jsonl")]
    assert len(generations) == 8 and all("tool_calls" in g and "turns" in g for g in generations)
    assert metrics["tool_call_rate"] == sum(g["tool_calls"] > 0 for g in generations) / 8
    assert metrics["mean_turns"] == sum(g["turns"] for g in generations) / 8
    env.write_text("tools: [calculate]\nmax_turnz: 2\n")
    bad = Proc(grpolab("eval", "--model", "embedded:tiny", "--data", "task:arithmetic", "--n", "2", "--out", out,
                       "--env", env), tmp_path, "bad").wait()
    assert bad.returncode == 2 and "unknown key(s) max_turnz" in bad.stderr and "Traceback" not in bad.stderr
    assert str(env) in bad.stderr
    # compare checks the file before its warm start: nothing is trained, nothing written
    bad = Proc(grpolab("compare", "--run-dir", tmp_path / "cmp", "--steps", "1", "--env", env), tmp_path, "cmp").wait()
    assert bad.returncode == 2 and "unknown key(s) max_turnz" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "cmp").exists()


def test_compare_with_an_env_evaluates_every_method_through_the_tools_and_grpo_trains_with_them(tmp_path):
    from grpolab.experiments.compare import run_compare

    env = {"tools": ["calculate"], "max_turns": 2, "max_total_tokens": 40}
    report = run_compare(tmp_path / "cmp", seed=0, steps=1, k=2, test_examples=4, warm_steps=3, show_progress=False,
                         env=env)
    assert report["env"] == env
    for name, row in report["methods"].items():  # tool figures exist only for multi-turn (environment) rollouts
        assert 0.0 <= row["tool_call_rate"] <= 1.0 and row["mean_tool_calls"] >= row["tool_call_rate"], name
    grpo_steps = [json.loads(line) for line in open(tmp_path / "cmp" / "grpo" / "metrics.jsonl")
                  if '"train/reward"' in line]
    assert grpo_steps and all("tools/call_rate" in r for r in grpo_steps)
    ppo_steps = [json.loads(line) for line in open(tmp_path / "cmp" / "ppo" / "metrics.jsonl")]
    assert not any("tools/call_rate" in r for r in ppo_steps)  # only GRPO takes an environment
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "answers calling a tool" in md and "GRPO trains with it" in md


def test_retrieval_augmented_prompts_from_a_config_put_each_questions_fact_in_its_prompt(grpo_config, tmp_path):
    from grpolab.data import get_task
    from grpolab.training.inputs import load_inputs

    options = {"num_entities": 60, "relations": "ruler,river"}
    corpus = get_task("retrieval", seed=0, **options).write_corpus(tmp_path / "corpus.jsonl")
    cfg = grpo_config(task="retrieval", task_options=options, task_train_size=40, prompt_template="rag_compact",
                      retrieval={"corpus": str(corpus), "top_k": 1, "cache_dir": str(tmp_path / "bm25")})
    inputs = load_inputs(cfg)
    prompts = [inputs.template.format(e.question) for e in inputs.train]
    assert all("{context}" not in p and e.question in p for p, e in zip(prompts, inputs.train))
    # the top passage is the question's own fact: its answer is in the prompt (a passage of another
    # entity or relation would not hold it)
    assert sum(e.answer in p for p, e in zip(prompts, inputs.train)) >= 0.95 * len(prompts)
    result = train_grpo(cfg.model_copy(update={"n_grpo_steps": 1}))  # a run validates on such prompts too
    samples = [json.loads(line) for f in (result.run_dir / "samples").glob("*.jsonl") for line in open(f)]
    assert samples and all("{context}" not in s["prompt"] and "Context: " in s["prompt"] for s in samples)
    assert sum(str(s["ground_truth"]) in s["prompt"] for s in samples) >= 0.9 * len(samples)


def test_a_context_template_without_retrieval_and_retrieval_without_one_are_one_line_errors(grpo_config, tmp_path):
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.data import TemplateError
    from grpolab.training.config import ConfigError

    with pytest.raises(TemplateError, match="rag_compact.*\\{context\\} placeholder.*retrieval: \\{corpus"):
        train_grpo(grpo_config(prompt_template="rag_compact"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a fact"}\n')
    with pytest.raises(TemplateError, match="retrieval is set but prompt template 'compact' has no \\{context\\}"):
        train_grpo(grpo_config(prompt_template="compact", retrieval={"corpus": str(corpus)}))
    with pytest.raises(ConfigError, match="'retrieval': unknown key\\(s\\) korpus"):
        GRPOConfig.build(overrides={"retrieval": {"korpus": "x.jsonl"}})
    with pytest.raises(ConfigError, match="'retrieval': needs a corpus"):
        GRPOConfig.build(overrides={"retrieval": {"top_k": 2}})


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_eval_with_a_rag_corpus_fills_context_and_without_one_says_so(tmp_path):
    from grpolab.data import get_task
    from tests.training.test_run import Proc, grpolab

    corpus = get_task("retrieval", seed=0).write_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "out"
    Proc(grpolab("eval", "--model", "embedded:tiny", "--data", "task:retrieval", "--n", "6", "--k", "1",
                 "--max-tokens", "8", "--prompt-template", "rag_compact", "--rag-corpus", corpus, "--out", out),
         tmp_path, "eval").ok()
    generations = [json.loads(line) for line in open(out / "generations.jsonl")]
    assert len(generations) == 6
    assert all("Context: " in g["prompt"] and str(g["ground_truth"]) in g["prompt"] for g in generations)
    bad = Proc(grpolab("eval", "--model", "embedded:tiny", "--data", "task:retrieval", "--n", "2", "--prompt-template",
                       "rag_compact", "--out", out), tmp_path, "bad").wait()
    assert bad.returncode == 2 and "--rag-corpus" in bad.stderr and "Traceback" not in bad.stderr
