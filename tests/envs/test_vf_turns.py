"""verifiers environments with turns, run for real: a custom two-turn game driven by the environment
against grpolab's chat endpoint (exact ids, the environment's turns masked, the rubric on the live
state), one that raises or hangs, a ``ToolEnv`` whose Python tool the model calls in its own
function-calling syntax, and a GRPO run on the game."""

import ast
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("verifiers", reason="the verifiers extra is not installed (pip install -e '.[envs]')")

from grpolab.algorithms.grpo import GRPOConfig, train_grpo  # noqa: E402
from grpolab.core import build_sequences  # noqa: E402
from grpolab.data.prompts.chat import ChatTemplate  # noqa: E402
from grpolab.data.tasks.vf import VerifiersTask  # noqa: E402
from grpolab.envs import EnvBackend  # noqa: E402
from grpolab.envs.vf import build_vf_env  # noqa: E402
from grpolab.models.fused_head import response_log_probs  # noqa: E402
from grpolab.models.tiny import build_tiny_model  # noqa: E402
from grpolab.rewards.scoring import RewardScorer  # noqa: E402
from grpolab.rewards.vf_reward import VfRubric  # noqa: E402
from grpolab.rollout import HFRolloutBackend, SamplingParams  # noqa: E402
from grpolab.training.metric_logging import read_metrics  # noqa: E402
from tests.envs.test_chat_tools import COMPACT_TOOLS, taught  # noqa: E402,F401 - the taught model fixture
from tests.helpers.chat_models import chat_model_dir, chat_tokenizer  # noqa: E402

HERE = Path(__file__).parent / "vf_envs"
GAME, CALC = str(HERE / "game_env.py"), str(HERE / "calc_tool_env.py")


def run_game(model, tok, n=2, args=None, **options):
    task = VerifiersTask(GAME, args or {})
    env = build_vf_env(GAME, args or {}, tokenizer=tok, **{"max_total_tokens": 80, **options})
    template = ChatTemplate(tok)
    backend = EnvBackend(HFRolloutBackend(model, tok), env, template=template)
    examples = task.examples("train", 3)
    try:
        out = backend.generate([template.format(e.question) for e in examples], n,
                               SamplingParams(temperature=1.0, max_tokens=12, seed=0))
    finally:
        env.close()
    return examples, out


@pytest.fixture(scope="module")
def tiny():
    tok = chat_tokenizer()
    return build_tiny_model("tiny", tok, seed=0).eval(), tok


def test_the_environment_drives_two_turns_and_the_trained_ids_are_the_sampled_ones(tiny):
    model, tok = tiny
    examples, out = run_game(model, tok)
    assert [r.prompt_index for r in out] == [0, 0, 1, 1, 2, 2]
    batch = build_sequences([r.prompt_ids for r in out], [r.response_ids for r in out], tok.pad_token_id)
    with torch.no_grad():
        lp = response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]
    for i, r in enumerate(out):
        assert r.info["turns"] == 2 and r.info["unchained_turns"] == 0 and r.info["env_errors"] == 0
        assert sum(r.loss_mask) == 24  # two model turns of 12 sampled tokens, each trained
        sampled = torch.tensor(r.loss_mask)
        start = len(r.prompt_ids) - 1
        assert torch.allclose(lp[i, start:start + len(r.response_ids)][sampled], torch.tensor(r.logprobs)[sampled],
                              atol=1e-4)
        secret = examples[r.prompt_index].answer["row"]["answer"]
        masked = tok.decode([t for t, m in zip(r.response_ids, r.loss_mask) if not m], skip_special_tokens=False)
        assert f"<|im_start|>user\nSay {secret}.<|im_end|>" in masked  # the environment's turn, not trained
        assert [m["role"] for m in r.messages] == ["assistant", "user", "assistant"]
        assert r.info["vf_score"]["turn_count"] == 2.0
    # the run's reward (in the reward workers) is the rubric's score on the live state
    with RewardScorer(VfRubric(GAME), timeout_s=60) as scorer:
        scores = scorer.score([r.scored_response for r in out], [examples[r.prompt_index].answer for r in out],
                              rollouts=out)
    assert [s["reward"] for s in scores] == [r.info["vf_score"]["reward"] for r in out]
    assert all(s["vf/turn_count"] == 2.0 for s in scores)


@pytest.mark.parametrize("fail, says", [("raise", "RuntimeError: the game broke"), ("hang", "timed out after 2.0s")])
def test_an_environment_that_raises_or_hangs_costs_its_rollout_only(tiny, capsys, fail, says):
    model, tok = tiny
    _, out = run_game(model, tok, n=1, args={"fail": fail}, rollout_timeout_s=2.0)
    assert all(r.info["env_errors"] == 1 and not any(r.loss_mask) for r in out)
    assert all(r.info["vf_score"]["reward"] == 0.0 for r in out)
    lines = [line for line in capsys.readouterr().err.splitlines() if "rollout failed" in line]
    assert len(lines) == 3 and all(says in line and "game_env.py" in line for line in lines)


def test_a_tool_environments_python_tool_is_called_in_the_models_own_syntax(taught):  # noqa: F811 - the fixture
    model, tok, _, _ = taught
    task = VerifiersTask(CALC)
    env = build_vf_env(CALC, tokenizer=tok, chat_template=COMPACT_TOOLS, max_total_tokens=240)
    assert [s["function"]["name"] for s in env.renderer.schemas] == ["calculate"] and env.max_turns == 3
    template = ChatTemplate(tok)
    backend = EnvBackend(HFRolloutBackend(model, tok), env, template=template)
    examples = task.examples("train", 2)
    calls = env.functions["calculate"].__globals__["CALLS"]  # the module verifiers loaded the file as
    calls_before = len(calls)
    out = backend.generate([template.format(e.question) for e in examples], 1,
                           SamplingParams(temperature=0.3, max_tokens=120, seed=0))
    assert calls[calls_before:] == ["12+30", "50-8"]  # the environment's own function ran
    with RewardScorer(task.reward_fn, timeout_s=60) as scorer:
        scores = scorer.score([r.scored_response for r in out], [e.answer for e in examples], rollouts=out)
    assert [s["reward"] for s in scores] == [1.0, 1.0]  # read from the conversation's last answer
    assert [s["vf/total_tool_calls"] for s in scores] == [1.0, 1.0]  # verifiers' own count of the calls


def test_a_grpo_run_on_the_game_trains_on_the_rubrics_reward(tmp_path):
    cfg = GRPOConfig(model=str(chat_model_dir(tmp_path / "m")), env={"verifiers": GAME, "max_total_tokens": 60},
                     n_grpo_steps=2, rollout_batch_size=8, group_size=4, train_batch_size=8,
                     gradient_accumulation_steps=2, sampling_max_tokens=6, sampling_min_tokens=1, learning_rate=1e-3,
                     warmup_steps=0, task_train_size=10, eval_examples=2, token_record_groups=2,
                     run_dir=str(tmp_path / "run"), show_progress=False, device="cpu")
    result = train_grpo(cfg)
    steps = [r for r in read_metrics(result.metrics_path) if "train/reward" in r]
    assert len(steps) == 2
    assert all(s["train/reward_vf/turn_count"] == 2.0 for s in steps)  # every rollout had both turns
    assert all(s["tools/turns"] == 2.0 for s in steps)
    records = [json.loads(line) for line in (Path(cfg.run_dir) / "tokens.jsonl").read_text().splitlines()]
    assert records and all(ast.literal_eval(g["answer"])["env"] == GAME for g in records)
