"""``evaluate``, ``log_generations``, token entropies and ``grpolab eval``'s ``evaluate_model`` and
report writing, on a scripted backend (fixed responses) and the embedded tiny model."""

import ast
import json
from pathlib import Path

import pytest
import torch

import grpolab.eval
from grpolab.core import build_sequences, compute_entropy, pad_token_id
from grpolab.data.datasets import Example
from grpolab.eval import EvalResult, evaluate, log_generations, token_entropies
from grpolab.eval.report import check_writable, evaluate_model, write_report
from grpolab.models import load_model_and_tokenizer
from grpolab.rewards import RewardScorer, is_equivalent
from grpolab.rollout import Rollout, SamplingParams


class _Template:
    def format(self, question):
        return f"Q: {question}\nA:"


class _Scripted:
    """A rollout backend that answers question i with ``responses[i]`` (one list entry per sample)."""

    def __init__(self, tokenizer, responses):
        self.tokenizer, self.responses, self.calls = tokenizer, responses, []

    def generate(self, prompts, n, sampling):
        self.calls.append((list(prompts), n, sampling))
        out = []
        for qi, prompt in enumerate(prompts):
            for text in self.responses[qi][:n]:
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                out.append(Rollout(prompt, text, self.tokenizer(prompt, add_special_tokens=False)["input_ids"], ids,
                                   [0.0] * len(ids), "stop", qi))
        return out


def _answer_reward(response, ground_truth):
    """1 when the <answer> block is equivalent to the ground truth; raises on 'boom'."""
    if "boom" in response:
        raise RuntimeError("grader crashed")
    answer = response.split("<answer>")[-1].split("</answer>")[0] if "<answer>" in response else None
    ok = answer is not None and is_equivalent(answer, str(ground_truth))
    return {"reward": float(ok), "format_reward": float(answer is not None), "answer_reward": float(ok)}


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("embedded:tiny", seed=0)


def _mean_entropy(model, tok, rollout, temperature):
    seq = build_sequences([rollout.prompt_ids], [rollout.response_ids], pad_token_id(tok))
    with torch.no_grad():
        ent = compute_entropy(model(seq["input_ids"]).logits / temperature)[0]
    mask = seq["response_mask"][0]
    return float((ent * mask).sum() / mask.sum())


# ---------------------------------------------------------------- package layout
def test_eval_package_init_only_re_exports():
    tree = ast.parse(Path(grpolab.eval.__file__).read_text())
    logic = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert logic == [], "grpolab/eval/__init__.py should only re-export"
    for fn in (evaluate, log_generations, token_entropies, EvalResult):
        assert fn.__module__ != "grpolab.eval"


# ---------------------------------------------------------------- guarded rewards
def test_evaluate_scores_a_failing_reward_zero_and_counts_it(tiny):
    _, tok = tiny
    backend = _Scripted(tok, [["<answer>3</answer>", "boom <answer>3</answer>"], ["boom", "<answer>7</answer>"]])
    examples = [Example("1+2", "3"), Example("3+4", "7")]
    result = evaluate(backend, examples, _Template(), _answer_reward, SamplingParams(max_tokens=8), n=2)
    assert [s["reward"] for s in result.scores] == [1.0, 0.0, 0.0, 1.0]
    assert result.metrics["reward_errors"] == 2 and result.metrics["accuracy"] == 0.5
    # a reused scorer: the metric counts this evaluation's errors, the scorer keeps the running total
    scorer = RewardScorer(_answer_reward, timeout_s=5.0)
    for _ in range(2):
        assert evaluate(backend, examples, _Template(), _answer_reward, SamplingParams(max_tokens=8), n=2,
                        scorer=scorer).metrics["reward_errors"] == 2
    assert scorer.errors == 4
    scorer.close()


def test_evaluate_model_counts_reward_errors_instead_of_crashing(tiny):
    model, tok = tiny
    backend = _Scripted(tok, [["<answer>3</answer>", "boom"]])
    m, gens = evaluate_model(model, tok, backend, [Example("1+2", "3")], _Template(), _answer_reward, k=2,
                             max_tokens=8, reward_timeout_s=5.0)
    assert m["reward_errors"] == 1 and [g["reward"] for g in gens] == [1.0, 0.0]


# ---------------------------------------------------------------- maj@k through evaluate_model
def test_evaluate_model_groups_equivalent_answers_and_scores_ties_as_expected_value(tiny):
    model, tok = tiny
    r1 = "ok</think> <answer>{}</answer>".format
    backend = _Scripted(tok, [
        [r1("0.5"), r1("1/2"), r1("0.25"), r1("3")],  # 0.5 = 1/2 has the majority
        [r1("7"), r1("7"), r1("8"), r1("8")],  # a tie; 7 is right
    ])
    examples = [Example("half", "1/2"), Example("3+4", "7")]
    m, gens = evaluate_model(model, tok, backend, examples, _Template(), _answer_reward, k=4, max_tokens=8)
    assert m["maj@4"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["consistency"] == pytest.approx((2 / 4 + 2 / 4) / 2)
    assert m["distinct_answers_per_question"] == pytest.approx((3 + 2) / 2)
    assert m["pass@1"] == pytest.approx((2 / 4 + 2 / 4) / 2) and m["pass@4"] == 1.0
    assert [g["answer"] for g in gens[:2]] == ["0.5", "1/2"]


# ---------------------------------------------------------------- entropy at the sampling temperature
def test_token_entropies_are_of_the_sampling_distribution(tiny):
    model, tok = tiny
    backend = _Scripted(tok, [["<answer>3</answer>"]])
    rollout = backend.generate(["Q: 1+2\nA:"], 1, None)[0]
    for t in (1.0, 0.5, 2.0):
        assert token_entropies(model, [rollout], tok, temperature=t)[0] == pytest.approx(
            _mean_entropy(model, tok, rollout, t), rel=1e-5)
    assert token_entropies(model, [rollout], tok, temperature=0.0) == token_entropies(model, [rollout], tok)


def test_evaluate_model_and_log_generations_use_the_sampling_temperature(tiny, tmp_path):
    model, tok = tiny
    backend = _Scripted(tok, [["<answer>3</answer>"]])
    m, _ = evaluate_model(model, tok, backend, [Example("1+2", "3")], _Template(), _answer_reward, k=1,
                          temperature=2.0, max_tokens=8)
    rollout = backend.generate([_Template().format("1+2")], 1, None)[0]
    expected = _mean_entropy(model, tok, rollout, 2.0)
    assert m["token_entropy"] == pytest.approx(expected, rel=1e-5)
    result = evaluate(backend, [Example("1+2", "3")], _Template(), _answer_reward, SamplingParams(temperature=2.0))
    extra = log_generations(tmp_path / "g.jsonl", result, 0, model, tok)
    assert extra["mean_token_entropy"] == pytest.approx(expected, rel=1e-5)
    assert json.loads((tmp_path / "g.jsonl").read_text())["mean_token_entropy"] == pytest.approx(expected, rel=1e-5)


def test_token_entropies_run_with_dropout_off(char_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(char_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.5,
                      pad_token_id=char_tokenizer.pad_token_id, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    rollout = _Scripted(char_tokenizer, [["<answer>12</answer>"]]).generate(["Q: 5+7\nA:"], 1, None)[0]
    first = token_entropies(model, [rollout], char_tokenizer)
    assert token_entropies(model, [rollout], char_tokenizer) == first and model.training


# ---------------------------------------------------------------- input errors, before any sampling
def test_evaluate_model_rejects_bad_k_and_no_questions_before_sampling(tiny):
    model, tok = tiny
    backend = _Scripted(tok, [["<answer>3</answer>"]])
    with pytest.raises(ValueError, match="--k .*must be at least 1, got 0"):
        evaluate_model(model, tok, backend, [Example("1+2", "3")], _Template(), _answer_reward, k=0)
    with pytest.raises(ValueError, match="^no questions to evaluate in data/empty.jsonl$"):
        evaluate_model(model, tok, backend, [], _Template(), _answer_reward, k=2, source="data/empty.jsonl")
    with pytest.raises(ValueError, match="perplexity needs at least two tokens"):
        evaluate_model(model, tok, backend, [Example("1+2", "3")], _Template(), _answer_reward, corpus_ids=[5])
    assert backend.calls == []


def test_check_writable_names_the_directory_and_the_reason(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"^cannot write to .*afile[/\\]out: .*afile is a file, not a directory$"):
        check_writable(tmp_path / "afile" / "out")
    with pytest.raises(ValueError, match=r"^cannot write to .*afile: it is a file, not a directory$"):
        check_writable(tmp_path / "afile")
    check_writable(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir() and list((tmp_path / "new" / "dir").iterdir()) == []


def test_write_report_refuses_an_unwritable_directory_and_writes_a_good_one(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="cannot write to"):
        write_report(tmp_path / "afile" / "out", {"accuracy": 1.0}, [])
    write_report(tmp_path / "ok", {"accuracy": 1.0}, [{"response": "r"}])
    assert json.loads((tmp_path / "ok" / "eval.json").read_text()) == {"accuracy": 1.0}
    assert (tmp_path / "ok" / "generations.jsonl").read_text() == '{"response": "r"}\n'
