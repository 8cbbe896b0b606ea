"""``grpolab eval``'s defaults are CS336's zero-shot baseline (issue 55): every example of the data,
k 1, temperature 1, top-p 1, 1,024 tokens, stop at </answer>; the prompt template is the one the model
was trained with (a grpolab run's final/), else r1_zero, never chosen by the tokenizer's chat template,
and one line says which and why."""

import json

from typer.testing import CliRunner

from grpolab import cli
from grpolab.algorithms.sft import SFTConfig, train_sft
from grpolab.cli.options import EvalOptions
from tests.helpers.chat_models import chat_model_dir

R1_ZERO_START = "A conversation between User and Assistant."


def _data(tmp_path, n=3):
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(n)))
    return path


def _eval(model, data, out, *args):
    return CliRunner().invoke(cli.app, ["eval", "--model", str(model), "--data", str(data), "--max-tokens", "4",
                                        "--no-entropy", "--out", str(out), *args])


def test_the_defaults_are_cs336_baseline():
    opts = EvalOptions(model="m", data="d")
    assert (opts.n, opts.k, opts.temperature, opts.top_p, opts.max_tokens, opts.stop) == \
        (None, 1, 1.0, 1.0, 1024, ["</answer>"])
    assert opts.dtype == "auto" and opts.prompt_template is None


def test_a_chat_model_is_evaluated_on_r1_zero_over_every_question(tmp_path):
    model = chat_model_dir(tmp_path / "chat")
    out = _eval(model, _data(tmp_path, 3), tmp_path / "eval")
    assert out.exit_code == 0, out.output
    assert "grpolab eval: prompt template r1_zero (the default (CS336's)" in out.output
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert (report["questions"], report["k"]) == (3, 1)  # every row of the file, one sample each
    generations = [json.loads(line) for line in (tmp_path / "eval" / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 3 and all(g["prompt"].startswith(R1_ZERO_START) for g in generations)
    assert all("<|im_start|>" not in g["prompt"] for g in generations)


def test_a_runs_final_model_is_evaluated_on_the_template_it_was_trained_with(tmp_path):
    run = tmp_path / "sft"
    train_sft(SFTConfig(model="embedded:tiny", task="arithmetic", prompt_template="question_only", n_sft_steps=1,
                        train_batch_size=2, gradient_accumulation_steps=1, task_train_size=4, eval_examples=1,
                        eval_every=0, run_dir=str(run), show_progress=False, device="cpu"))
    out = _eval(run / "final", _data(tmp_path, 2), tmp_path / "eval", "--top-p", "0.9")
    assert out.exit_code == 0, out.output
    line = next(x for x in out.output.splitlines() if "prompt template" in x)
    assert line == (f"grpolab eval: prompt template question_only (the template {run / 'final'} was trained with, "
                    f"from {run / 'config.yaml'})")
    generations = [json.loads(x) for x in (tmp_path / "eval" / "generations.jsonl").read_text().splitlines()]
    assert [g["prompt"] for g in generations] == ["What is 0 + 1?", "What is 1 + 1?"]


def test_a_model_sft_trained_on_cs336_prompts_is_evaluated_on_r1_zero(tmp_path):
    """The run's config names no template, and its sft.jsonl prompts held r1_zero (the template the
    run detected and trained and validated with): eval uses it, not the chat template's chat_r1."""
    from tests.algorithms.test_sft_formatted_prompts import _cs336_files

    sft, validation = _cs336_files(tmp_path)
    run = tmp_path / "sft"
    train_sft(SFTConfig(model=str(chat_model_dir(tmp_path / "chat")), train_data=str(sft), n_sft_steps=1,
                        train_batch_size=2, gradient_accumulation_steps=1, warmup_steps=0, run_dir=str(run),
                        show_progress=False, device="cpu"))
    out = _eval(run / "final", validation, tmp_path / "eval")
    assert out.exit_code == 0, out.output
    assert f"grpolab eval: prompt template r1_zero (the template {run / 'final'} was trained with" in out.output


def test_a_run_trained_on_a_verifiers_environment_is_evaluated_on_the_template_it_trained_with(tmp_path):
    """A run on ``env: {verifiers: FILE}`` names no template: training chose plain ``chat`` (the
    environment's rubric reads no <answer> tags); eval chooses the same, not chat_r1 (it did, and a
    held-out eval of such a run needed --prompt-template chat to see what was trained)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from grpolab.cli.eval import eval_template

    env_file = Path(__file__).resolve().parents[2] / "configs" / "envs" / "vf_arithmetic_v1.py"
    run = tmp_path / "run"
    model = chat_model_dir(run / "final")
    (run / "config.yaml").write_text(f"env:\n  verifiers: {env_file}\n  args: {{n: 20}}\nseed: 0\n")
    opts = EvalOptions(model=str(model), data=f"vf:{env_file}")
    name, _ = eval_template(opts, AutoTokenizer.from_pretrained(model))
    assert name == "chat"
