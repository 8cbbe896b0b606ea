"""An environment written against verifiers' current API (``verifiers.v1``: a ``Taskset`` of ``Task``
objects with ``@vf.reward`` methods, the only API of verifiers 0.4) through ``env: {verifiers: FILE}``:
its tasks are the rows, the task's rewards score grpolab's replies over a ``vf.Trace`` (in the reward
workers), a short GRPO run trains with no reward error and ``grpolab eval`` reports its figures.
Runs on whichever verifiers is installed that ships ``verifiers.v1`` (0.3.1 in .venv; 0.4.0 in .venv-vf04)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers with its v1 API is not installed (pip install -e '.[envs]')")

from grpolab.algorithms.grpo import GRPOConfig, train_grpo  # noqa: E402
from grpolab.data.tasks.vf import VerifiersTask  # noqa: E402
from grpolab.rewards.vf_reward import VfRubric  # noqa: E402
from grpolab.training.metric_logging import read_metrics  # noqa: E402
from tests.envs.test_chat_tools import COMPACT_TOOLS, taught  # noqa: E402,F401 - the taught model fixture
from tests.helpers.chat_models import chat_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SUM_V1 = str(Path(__file__).parent / "vf_envs" / "sum_taskset_v1.py")


def expected(reply: str, answer: str) -> dict[str, float]:
    """The taskset's rewards by its own rule (sum_taskset_v1's docstring), computed here apart."""
    numbers = re.findall(r"-?\d+", reply.strip())
    correct = 1.0 if numbers and numbers[-1] == answer else 0.0
    short = 1.0 if len(reply.strip()) <= 8 else 0.0
    return {"reward": correct + 0.1 * short, "vf/correct": correct, "vf/short": short,
            "vf/length": float(len(reply.strip()))}


def test_a_v1_taskset_is_the_task_and_its_rewards_the_reward():
    task = VerifiersTask(SUM_V1, {"n": 40})
    assert task.kind == "single_turn" and sum(task.size(s) for s in ("train", "validation", "test")) == 40
    example = task.examples("train", 1)[0]
    assert example.question[0] == {"role": "system", "content": "Answer with the number only."}
    assert example.question[1]["role"] == "user" and example.question[1]["content"].startswith("What is ")
    answer = str(sum(int(n) for n in re.findall(r"\d+", example.question[1]["content"])))
    rubric = VfRubric(SUM_V1, {"n": 40})
    for reply in (answer, "8" if answer != "8" else "9", f"the answer is {answer}"):
        assert rubric(reply, example.answer) == pytest.approx(expected(reply, answer))
    with pytest.raises(ValueError, match="do not fit its SumConfig"):
        VerifiersTask(SUM_V1, {"n": "many"})


@pytest.mark.slow  # make test-slow (test-all), not make test: a whole run or CLI process
def test_a_grpo_run_on_a_v1_taskset_trains_and_grpolab_eval_reports_it(tmp_path):
    cfg = GRPOConfig(model=str(chat_model_dir(tmp_path / "m")), env={"verifiers": SUM_V1, "args": {"n": 64}},
                     n_grpo_steps=3, rollout_batch_size=8, group_size=4, train_batch_size=8,
                     gradient_accumulation_steps=2, sampling_max_tokens=4, sampling_min_tokens=1, learning_rate=1e-3,
                     warmup_steps=0, task_train_size=20, eval_examples=4, token_record_groups=2,
                     run_dir=str(tmp_path / "run"), show_progress=False, device="cpu")
    result = train_grpo(cfg)
    steps = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert len(steps) == 3 and all(r["health/reward_errors"] == 0 for r in steps)
    records = [json.loads(line) for line in (Path(cfg.run_dir) / "tokens.jsonl").read_text().splitlines()]
    for step, record in enumerate(steps):
        scored = [(ast.literal_eval(g["answer"]), r) for g in records if g["step"] == step for r in g["responses"]]
        assert scored  # every recorded reply got the task's rewards, computed apart here
        for truth, r in scored:
            content = next(m["content"] for m in truth["row"]["prompt"] if m["role"] == "user")
            answer = str(sum(int(n) for n in re.findall(r"\d+", content)))
            assert r["reward"] == round(expected(r["text"], answer)["reward"], 4)
        assert "train/reward_vf/correct" in record and "train/reward_vf/short" in record
    out = tmp_path / "eval"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "grpolab", "eval", "--model", str(Path(cfg.run_dir) / "final"),
                           "--data", f"vf:{SUM_V1}", "--n", "4", "--k", "1", "--max-tokens", "4", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["n"] == 4 and report["reward_errors"] == 0 and 0 <= report["accuracy"] <= 1
    # accuracy is the answer reward's (correct: the largest weight) share at 1; the reward its weighted sum
    assert report["accuracy"] == report["vf/correct"]
    assert report["reward"] == pytest.approx(report["vf/correct"] + 0.1 * report["vf/short"])


CALC_V1 = str(Path(__file__).parent / "vf_envs" / "calc_taskset_v1.py")


def test_a_v1_toolset_taskset_runs_its_tools_each_turn_and_a_grpo_run_trains_on_it(taught, tmp_path):  # noqa: F811
    """grpolab plays verifiers' null harness: the taught model calls the toolset's ``calculate`` in its own
    syntax, grpolab runs the @vf.tool method (the rollout's state counts the call), appends the result and
    samples the answer; the task's rewards read the trace (its tool message, its state)."""
    from grpolab.data.prompts.chat import ChatTemplate
    from grpolab.envs import EnvBackend
    from grpolab.envs.vf import build_vf_env
    from grpolab.rewards.scoring import RewardScorer
    from grpolab.rollout import HFRolloutBackend, SamplingParams

    model, tok, _, _ = taught
    task = VerifiersTask(CALC_V1)
    assert task.kind == "tool"
    env = build_vf_env(CALC_V1, tokenizer=tok, chat_template=COMPACT_TOOLS, max_total_tokens=240, max_turns=3)
    assert [s["function"]["name"] for s in env.renderer.schemas] == ["calculate"]  # TOOL_PREFIX None: bare
    template = ChatTemplate(tok)
    backend = EnvBackend(HFRolloutBackend(model, tok), env, template=template)
    examples = task.examples("train", 1) + task.examples("validation", 1)
    out = backend.generate([template.format(e.question) for e in examples], 1,
                           SamplingParams(temperature=0.3, max_tokens=120, seed=0))
    for r, e in zip(out, examples):
        expr = e.question[-1]["content"].removeprefix("What is ").removesuffix("?")
        tool = [m for m in r.messages if m["role"] == "tool"]
        assert [m["content"] for m in tool] == ["42"] and r.info["vf_state"] == {"artifacts": {}, "calls": 1}
        assert json.loads(r.messages[0]["tool_calls"][0]["function"]["arguments"]) == {"expression": expr}
    with RewardScorer(task.reward_fn, timeout_s=60) as scorer:
        scores = scorer.score([r.scored_response for r in out], [e.answer for e in examples], rollouts=out)
    assert [(s["reward"], s["vf/tool_calls"], s["vf/tool_results"]) for s in scores] == [(1.0, 1.0, 1.0)] * 2
    cfg = GRPOConfig(model="taught", env={"verifiers": CALC_V1, "chat_template": COMPACT_TOOLS, "max_turns": 3,
                                          "max_total_tokens": 120},
                     n_grpo_steps=2, rollout_batch_size=4, group_size=2, train_batch_size=4,
                     gradient_accumulation_steps=1, sampling_max_tokens=60, sampling_temperature=1.0,
                     learning_rate=1e-4, warmup_steps=0, task_train_size=1, eval_examples=1, token_record_groups=2,
                     run_dir=str(tmp_path / "run"), show_progress=False, device="cpu")
    result = train_grpo(cfg, model=model, tokenizer=tok)
    steps = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert len(steps) == 2 and all(r["health/reward_errors"] == 0 for r in steps)
    assert all("train/reward_vf/tool_results" in r for r in steps)


@pytest.mark.parametrize("source, says", [
    ("class T(vf.Task[D]):\n    NEEDS_CONTAINER = True", "task T sets NEEDS_CONTAINER"),
    ("class T(vf.Task[D]):\n    async def setup(self, trace, runtime): pass", "task T overrides setup(trace, runtime)"),
    ("class T(vf.Task[D]):\n    @classmethod\n    def toolsets(cls, config):\n"
     "        return [R(vf.ToolsetConfig(url='http://mcp.example:9/mcp'))]", "toolset R has a url"),
    ("class T(vf.Task[D]):\n    def __init__(self, data, config=None):\n"
     "        super().__init__(data, vf.TaskConfig(judges=[{'id': 'reference'}]))",
     "task.judges[0].base_url is 'https://"),
    ("class T(vf.Task[D]):\n    pass\nclass H(vf.Harness):\n    async def launch(self, *a): pass\n__all__ = ['S', 'H']",
     "exports the harness H"),
])
def test_what_needs_a_sandbox_or_a_remote_service_is_refused_in_one_line(tmp_path, source, says):
    path = tmp_path / "refused_v1.py"
    path.write_text("import verifiers.v1 as vf\nclass D(vf.TaskData):\n    pass\n"
                    "class R(vf.Toolset[vf.ToolsetConfig]):\n    @vf.tool\n"
                    "    async def echo(self, text: str) -> str:\n"
                    "        return text\n" + source.split("\n__all__")[0] + "\n"
                    "class S(vf.Taskset[T, vf.TasksetConfig]):\n    def load(self):\n        yield T(D(prompt='hi'))\n"
                    + ("__all__" + source.split("__all__")[1] if "__all__" in source else "__all__ = ['S']") + "\n")
    with pytest.raises(ValueError) as err:
        VerifiersTask(str(path))
    line = str(err.value)
    assert says in line and "\n" not in line and "refused_v1.py" in line
