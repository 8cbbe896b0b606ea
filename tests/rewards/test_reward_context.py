"""A reward reads the prompt, the question or the conversation by declaring it; a reward module beside the
config imports without PYTHONPATH from the console script (issue 59)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpolab.rewards import RewardScorer
from grpolab.rewards.registry import reward_reads

REWARD = textwrap.dedent('''
    def sees_prompt(response, ground_truth, prompt, question, messages=None):
        seen = str(question) in prompt and messages[-1]["content"] == question
        return {"reward": float(seen), "format_reward": 1.0, "answer_reward": float(seen)}

    def text_only(response, ground_truth):
        return {"reward": 1.0}
''')


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "ctx_rewards_59.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(folder))
    yield "ctx_rewards_59"
    sys.modules.pop("ctx_rewards_59", None)


@pytest.mark.parametrize("isolation", ["process", "inprocess"])
def test_a_reward_gets_the_context_it_declares(reward_module, isolation):
    with RewardScorer(f"{reward_module}:sees_prompt", isolation=isolation) as scorer:
        scores = scorer.score(["a", "b"], ["2", "4"], prompts=["Q: 1+1 A:", "Q: 9 A:"], questions=["1+1", "2+2"])
        assert [s["reward"] for s in scores] == [1.0, 0.0] and scorer.errors == 0
    weighted = [{"fn": f"{reward_module}:sees_prompt"}, {"fn": f"{reward_module}:text_only", "weight": 0.5}]
    with RewardScorer(weighted, isolation=isolation) as scorer:
        assert scorer.score(["a"], ["2"], prompts=["Q: 1+1 A:"], questions=["1+1"])[0]["reward"] == 1.5
    from ctx_rewards_59 import sees_prompt, text_only

    assert reward_reads(sees_prompt) == ("prompt", "question", "messages") and reward_reads(text_only) == ()


def test_a_reward_module_beside_the_config_imports_from_the_console_script(tmp_path):
    configs, elsewhere = tmp_path / "configs", tmp_path / "elsewhere"
    configs.mkdir()
    elsewhere.mkdir()
    (configs / "beside_rewards_59.py").write_text(REWARD)
    (configs / "grpo.yaml").write_text(textwrap.dedent(f"""\
        model: embedded:tiny
        task: arithmetic
        reward: beside_rewards_59:sees_prompt
        run_dir: {tmp_path / 'run'}
        n_grpo_steps: 1
        rollout_batch_size: 4
        group_size: 2
        train_batch_size: 4
        gradient_accumulation_steps: 2
        sampling_max_tokens: 6
        eval_examples: 2
        show_progress: false
        threads: 1
        """))
    grpolab = Path(sys.executable).parent / "grpolab"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(grpolab), "grpo", "--config", str(configs / "grpo.yaml")], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["train/reward"] for r in records if "train/reward" in r]
    assert rewards and all(r == 1.0 for r in rewards)  # every rollout's reward saw its prompt and question
