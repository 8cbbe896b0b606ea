"""verifiers environments (``env: {verifiers: NAME}``) as a grpolab task and reward, against the real
verifiers package: the environments are written here (``vf_envs/``). The rows become examples with
disjoint splits; the supervised reward workers score with exactly what verifiers' own rollout scores;
a hanging rubric is a counted timeout, NaN an error; load failures are one line; grpolab's signal
handlers survive a load; and a short GRPO run logs the rubric's reward."""

from __future__ import annotations

import ast
import asyncio
import json
import math
import signal
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="verifiers is not installed (pip install -e '.[envs]')")

import verifiers as vf  # noqa: E402
from verifiers.types import Response, ResponseMessage  # noqa: E402

from grpolab.algorithms.grpo import GRPOConfig, train_grpo  # noqa: E402
from grpolab.data import TemplateError  # noqa: E402
from grpolab.data.tasks.vf import VerifiersTask  # noqa: E402
from grpolab.envs.vf import build_vf_env  # noqa: E402
from grpolab.rewards import RewardScorer  # noqa: E402
from grpolab.rewards.vf_reward import VfRubric  # noqa: E402
from grpolab.rewards.vf_rubric import (  # noqa: E402
    load_vf_environment,
    require_verifiers,
    rollout_state,
    signal_handlers_kept,
)
from grpolab.training.config import ConfigError  # noqa: E402
from grpolab.training.inputs import load_inputs, task_or_file  # noqa: E402
from grpolab.training.metric_logging import read_metrics  # noqa: E402
from tests.envs.vf_envs import sum_env  # noqa: E402
from tests.helpers.chat_models import chat_model_dir  # noqa: E402

HERE = Path(__file__).parent / "vf_envs"
SUM_ENV, BROKEN_ENV = str(HERE / "sum_env.py"), str(HERE / "broken_env.py")


class FixedReply(vf.Client):
    """A verifiers client whose model always answers ``reply``: verifiers' own rollout, then its own
    scoring, with no model server."""

    def __init__(self, reply: str):
        super().__init__(None)
        self.reply = reply

    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        return self.reply

    async def raise_from_native_response(self, response):
        return None

    async def from_native_response(self, response):
        return Response(id="fixed", created=0, model="fixed",
                        message=ResponseMessage(content=response, finish_reason="stop", is_truncated=False))

    async def close(self):
        return None


def verifiers_score(ground_truth: dict, reply: str) -> dict[str, float]:
    """What verifiers itself scores: a rollout of the row through ``run_rollout`` answered ``reply``."""
    env = load_vf_environment(ground_truth["env"], ground_truth["args"])
    out = asyncio.run(env.run_rollout(ground_truth["row"], FixedReply(reply), "fixed", {}))
    return {"reward": out["reward"], **{f"vf/{k}": v for k, v in out["metrics"].items()}}


# ---------------------------------------------------------------- examples and splits
def test_examples_carry_the_environments_prompts_and_answers_and_the_splits_do_not_overlap():
    task = VerifiersTask(SUM_ENV)
    assert (task.name, task.kind, task.default_template, task.tool_functions()) == \
        (f"vf:{SUM_ENV}", "single_turn", "chat", {})
    splits = {s: task.examples(s, task.size(s)) for s in ("train", "validation", "test")}
    rows = sum_env.rows(64)
    for split, examples in splits.items():
        assert examples and all(e.meta["split"] == split for e in examples)
        for e in examples:
            i = e.meta["vf_index"]
            assert e.question == [{"role": "system", "content": sum_env.SYSTEM_PROMPT},
                                  {"role": "user", "content": rows[i]["question"]}]
            assert e.answer["row"]["answer"] == rows[i]["answer"] and e.answer["row"]["prompt"] == e.question
            assert e.meta["source"] == f"vf:{SUM_ENV}:{split}:{i}"
            json.dumps(e.answer)  # plain data: it goes to a worker process
    indices = [{e.meta["vf_index"] for e in xs} for xs in splits.values()]
    assert sorted(i for part in indices for i in part) == list(range(64))  # every row, in exactly one split
    assert [e.meta["vf_index"] for e in task.examples("train", 3)] == [e.meta["vf_index"] for e in splits["train"][:3]]
    with pytest.raises(ValueError) as err:
        task.examples("train", 1000)
    assert str(err.value) == (f"task 'vf:{SUM_ENV}' has {len(splits['train'])} train rows (its dataset), fewer than "
                              f"the 1000 asked (task_train_size, eval_examples): ask for at most "
                              f"{len(splits['train'])}")


def test_an_eval_dataset_is_the_validation_and_test_split():
    task = VerifiersTask(SUM_ENV, {"n": 30, "eval_n": 10})
    train, validation, test = (task.examples(s, task.size(s)) for s in ("train", "validation", "test"))
    assert [e.meta["vf_index"] for e in train] == list(range(30)) and len(validation) == 10
    assert [e.question for e in validation] == [e.question for e in test]
    assert not {str(e.question) for e in train} & {str(e.question) for e in validation}
    assert validation[0].question[-1]["content"] == sum_env.rows(40)[30]["question"]


def test_a_module_spec_and_a_tool_environment():
    by_module = VerifiersTask("tests.envs.vf_envs.sum_env", {"n": 9})
    assert by_module.size("train") + by_module.size("validation") + by_module.size("test") == 9
    tools = VerifiersTask(BROKEN_ENV, {"kind": "tool"})
    assert tools.kind == "tool" and list(tools.tool_functions()) == ["tool_add"]
    assert tools.tool_functions()["tool_add"](a=2, b=3) == 5


def test_the_run_environment_of_a_single_turn_one_is_none_and_the_rest_is_one_line():
    assert build_vf_env(SUM_ENV, {}, tokenizer=None) is None  # nothing runs between turns
    with pytest.raises(ValueError, match=r"its turns are rendered by the model's chat template; a tokenizer"):
        build_vf_env(BROKEN_ENV, {"kind": "tool"})  # a ToolEnv (tests/envs/test_vf_turns.py runs one)
    with pytest.raises(ValueError, match=r"^env key\(s\) max_turns do not apply to the single-turn verifiers env"):
        build_vf_env(SUM_ENV, {}, max_turns=3)


# ---------------------------------------------------------------- one-line load failures
@pytest.mark.parametrize("spec,args,says", [
    (BROKEN_ENV, {"kind": "raise"}, "load_environment raised RuntimeError: the dataset is gone"),
    (BROKEN_ENV, {"kind": "not_env"}, "load_environment returned dict, not a verifiers Environment"),
    (str(HERE / "missing.py"), {}, "not found: no such file"),
    ("no-such-vf-environment", {}, "not found: no module 'no_such_vf_environment'"),
    ("tests.envs.vf_envs", {}, "module tests.envs.vf_envs defines no load_environment function"),
    (SUM_ENV, {"n": object()}, "must be plain data (JSON)"),
    (BROKEN_ENV, {"banana": 1}, "load_environment raised TypeError: load_environment() got an unexpected keyword"),
])
def test_load_failures_are_one_line_naming_the_environment(spec, args, says):
    with pytest.raises(ValueError) as err:
        load_vf_environment(spec, args)
    message = str(err.value)
    assert says in message and f"verifiers environment {spec!r}" in message and "\n" not in message, message


def test_without_verifiers_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # what an interpreter without the package imports
    with pytest.raises(ValueError, match=r"^env.verifiers needs the verifiers package, which is not installed: "
                                         r"pip install -e '\.\[envs\]'"):
        require_verifiers()


def test_a_file_that_fails_to_import_or_has_no_load_environment_is_one_line(tmp_path):
    (tmp_path / "bad.py").write_text("import no_such_package_for_vf\n")
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match=r"bad.py raised ModuleNotFoundError: No module named 'no_such_package_fo"):
        load_vf_environment(str(tmp_path / "bad.py"))
    with pytest.raises(ValueError, match=r"empty.py defines no load_environment function \(nor exports a "
                                         r"verifiers.v1 Taskset subclass via __all__\)$"):
        VerifiersTask(str(tmp_path / "empty.py"))


def test_signal_handlers_are_restored_after_a_load():
    def ours(signum, frame):  # pragma: no cover - never delivered
        pass

    old = {s: signal.signal(s, ours) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with signal_handlers_kept():  # verifiers itself replaces both (what the loader must undo)
            sum_env.load_environment(n=3)
            assert signal.getsignal(signal.SIGTERM) is not ours and signal.getsignal(signal.SIGINT) is not ours
        assert signal.getsignal(signal.SIGTERM) is ours
        load_vf_environment(SUM_ENV, {"n": 4})  # args no other test uses: a fresh load, not the cache
        assert signal.getsignal(signal.SIGTERM) is ours and signal.getsignal(signal.SIGINT) is ours
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def test_a_load_off_the_main_thread_is_one_line_and_the_cache_serves_every_thread():
    loaded = load_vf_environment(SUM_ENV, {"n": 6})
    out = {}

    def load(args):
        try:
            out[args["n"]] = load_vf_environment(SUM_ENV, args)
        except ValueError as exc:
            out[args["n"]] = str(exc)

    for args in ({"n": 6}, {"n": 7}):
        thread = threading.Thread(target=load, args=(args,))
        thread.start()
        thread.join()
    assert out[6] is loaded
    assert out[7].endswith("signal only works in main thread of the main interpreter (verifiers environments load "
                           "in the main thread only: an Environment sets signal handlers)") and "\n" not in out[7]


# ---------------------------------------------------------------- scoring in the reward workers
def test_the_workers_score_exactly_what_verifiers_scores():
    truth = VerifiersTask(SUM_ENV).examples("train", 4)[3].answer  # "What is 3 + 0?"
    answer = truth["row"]["answer"]
    responses = [answer, str(int(answer) + 1), f"so it is {answer}", [{"role": "assistant", "content": answer}]]
    with RewardScorer(VfRubric(SUM_ENV), timeout_s=60) as scorer:
        assert scorer.mode == "process"  # rebuilt in a supervised worker from its configured spec
        scores = scorer.score(responses, [truth] * len(responses))
        assert scorer.errors == 0, scorer.last_error
    expected = [verifiers_score(truth, r if isinstance(r, str) else r[-1]["content"]) for r in responses]
    assert scores == expected
    assert [s["reward"] for s in scores] == [1.1, 0.1, 1.0, 1.1]  # 1.0 x correct_answer + 0.1 x short_answer
    assert scores[0] == {"reward": 1.1, "vf/correct_answer": 1.0, "vf/short_answer": 1.0, "vf/num_turns": 1.0}


def test_a_rollouts_view_is_scored_by_its_messages_or_its_live_score():
    truth = VerifiersTask(SUM_ENV).examples("train", 4)[3].answer
    answer = truth["row"]["answer"]
    vf_rubric_reward = VfRubric(SUM_ENV)
    assert vf_rubric_reward.reads_rollout  # RewardScorer hands it each rollout's view
    by_text = vf_rubric_reward(answer, truth)
    assert vf_rubric_reward({"response": answer, "messages": None, "info": {}}, truth) == by_text
    said = {"response": "ignored", "messages": [{"role": "assistant", "content": answer}], "info": {}}
    assert vf_rubric_reward(said, truth) == by_text
    live = {"response": "", "messages": [], "info": {"vf_score": {"reward": 0.5, "correct_answer": 0.5}}}
    assert vf_rubric_reward(live, truth) == {"reward": 0.5, "vf/correct_answer": 0.5}
    with pytest.raises(ValueError, match=r"the rubric's vf/correct_answer is inf \(NaN or inf is an error"):
        vf_rubric_reward({**live, "info": {"vf_score": {"reward": 0.5, "correct_answer": math.inf}}}, truth)


def test_a_hanging_rubric_is_a_counted_timeout_not_a_stall():
    truth = VerifiersTask(BROKEN_ENV, {"kind": "hang"}).examples("train", 1)[0].answer
    with RewardScorer(VfRubric(BROKEN_ENV, {"kind": "hang"}), timeout_s=3) as scorer:
        # the rubric sleeps 600 s: that this returns at all is the worker killed at the timeout, not waited for
        scores = scorer.score([truth["row"]["answer"]], [truth])
        assert scorer.mode == "process"
    assert scores[0]["reward"] == 0.0 and (scorer.errors, scorer.timeouts) == (1, 1)
    assert scorer.last_error.startswith("timed out after 3")


def test_nan_is_an_error_not_a_reward():
    truth = VerifiersTask(BROKEN_ENV, {"kind": "nan"}).examples("train", 1)[0].answer
    env = load_vf_environment(BROKEN_ENV, {"kind": "nan"})
    state = rollout_state(env, truth["row"], [{"role": "assistant", "content": "1"}])
    asyncio.run(env.rubric.score_rollout(state))
    assert math.isnan(state["reward"])  # verifiers passes NaN through: grpolab must not
    vf_rubric_reward = VfRubric(BROKEN_ENV, {"kind": "nan"})
    with pytest.raises(ValueError, match=r"the rubric's reward is nan \(NaN or inf is an error, not a reward\)$"):
        vf_rubric_reward("1", truth)
    with RewardScorer(vf_rubric_reward, timeout_s=60) as scorer:
        scores = scorer.score(["1"], [truth])
    assert scores[0]["reward"] == 0.0 and scorer.errors == 1 and scorer.timeouts == 0
    assert "NaN or inf is an error" in scorer.last_error


def test_a_bad_ground_truth_or_response_is_one_line():
    vf_rubric_reward = VfRubric(SUM_ENV)
    with pytest.raises(ValueError, match=r"^vf_rubric: expected the ground truth of a VerifiersTask example"):
        vf_rubric_reward("7", "7")
    truth = VerifiersTask(SUM_ENV).examples("train", 1)[0].answer
    with pytest.raises(ValueError, match=r"^vf_rubric: expected the response text, a list of chat messages"):
        vf_rubric_reward(7, truth)
    with pytest.raises(ValueError, match=r"the row or completion is not verifiers chat messages \(ValidationError: "):
        vf_rubric_reward([{"role": "tool", "content": "5"}], truth)  # a tool message without its tool_call_id


# ---------------------------------------------------------------- config and inputs
def test_env_verifiers_is_the_runs_data_source():
    cfg = GRPOConfig(env={"verifiers": SUM_ENV})
    assert cfg.task is None and cfg.env == {"verifiers": SUM_ENV}
    for given in ({"task": "arithmetic"}, {"train_data": "data.jsonl"}):
        with pytest.raises(ConfigError) as err:
            GRPOConfig.build(None, {"env": {"verifiers": SUM_ENV}, **given})
        assert f"env.verifiers is the run's data (its environment's dataset): give no {next(iter(given))} with it" \
            in str(err.value) and "\n" not in str(err.value).strip()


def test_load_inputs_takes_the_environments_rows_chat_template_and_rubric(tmp_path):
    model = str(chat_model_dir(tmp_path / "m"))
    inputs = load_inputs(GRPOConfig(model=model, env={"verifiers": SUM_ENV}, task_train_size=10))
    task = VerifiersTask(SUM_ENV)
    assert [e.question for e in inputs.train] == [e.question for e in task.examples("train", 10)]
    assert len(inputs.evals) == task.size("validation")  # a fixed evaluation set: its rows, up to eval_examples
    assert isinstance(inputs.reward, VfRubric) and inputs.reward.env == SUM_ENV and inputs.template.name == "chat"
    prompt = inputs.template.format(inputs.train[0].question)
    assert prompt.startswith(f"<|im_start|>system\n{sum_env.SYSTEM_PROMPT}<|im_end|>") and "What is 0 + 0?" in prompt
    examples, _, reward = task_or_file(f"vf:{SUM_ENV}", 500, tokenizer=inputs.template.tokenizer)  # grpolab eval
    assert len(examples) == task.size("test") and isinstance(reward, VfRubric)
    with pytest.raises(TemplateError, match="has no chat template"):  # the rows are conversations
        load_inputs(GRPOConfig(env={"verifiers": SUM_ENV}, task_train_size=10))


# ---------------------------------------------------------------- a real run
def test_a_grpo_run_logs_the_rubrics_reward(tmp_path):
    cfg = GRPOConfig(model=str(chat_model_dir(tmp_path / "m")), env={"verifiers": SUM_ENV}, n_grpo_steps=2,
                     rollout_batch_size=8, group_size=4, train_batch_size=8, gradient_accumulation_steps=2,
                     sampling_max_tokens=4, sampling_min_tokens=1, learning_rate=1e-3, warmup_steps=0,
                     task_train_size=20, eval_examples=4, token_record_groups=2, run_dir=str(tmp_path / "run"),
                     show_progress=False, device="cpu")
    result = train_grpo(cfg)
    steps = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    records = [json.loads(line) for line in (Path(cfg.run_dir) / "tokens.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and len(records) == 4  # every group of both steps recorded
    for step, record in enumerate(steps):
        responses = [(ast.literal_eval(g["answer"]), r) for g in records if g["step"] == step for r in g["responses"]]
        expected = [verifiers_score(truth, r["text"]) for truth, r in responses]
        assert [r["reward"] for _, r in responses] == [round(e["reward"], 4) for e in expected]
        assert record["train/reward"] == pytest.approx(sum(e["reward"] for e in expected) / len(expected), abs=1e-6)
        assert record["train/reward_vf/short_answer"] == pytest.approx(
            sum(e["vf/short_answer"] for e in expected) / len(expected), abs=1e-6)
        assert record["train/reward"] > 0  # the rubric's 0.1 for a short answer: no built-in reward gives it
