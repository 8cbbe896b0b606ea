"""Native function calling learned by the real model (issue 59 item 5): SmolLM2-135M-Instruct, given
the calculate tool in the hermes format, calls it on (almost) no held-out question; a few SFT steps on
the shipped demonstrations (configs/real/smollm2_135m_tool_demos.jsonl, replayed in the chat-template
format: the tool turns masked) make it call the tool on held-out questions of the task's test split,
sampled through the environment as GRPO's rollouts are. docs/results/tools-real.md has the full recipe."""

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SFT_CONFIG = yaml.safe_load((ROOT / "configs/real/smollm2_135m_sft_tools.yaml").read_text(encoding="utf-8"))
TASK_OPTIONS = {"digits": 3, "num_ops": 1, "ops": "*", "phrasing": "words"}
ROWS, STEPS, HELD_OUT = 32, 4, 16


def call_rate(model, tokenizer, questions: list[str]) -> float:
    """The share of greedy answers, sampled through the recipe's environment, that called a tool."""
    from grpolab.data.prompts.chat import ChatTemplate
    from grpolab.envs import EnvBackend, build_env
    from grpolab.rollout import HFRolloutBackend, SamplingParams

    env = build_env(tokenizer=tokenizer, **SFT_CONFIG["env"])
    template = ChatTemplate(tokenizer, system_prompt=SFT_CONFIG["system_prompt"])
    backend = EnvBackend(HFRolloutBackend(model, tokenizer), env, template=template)
    rollouts = backend.generate([template.format(q) for q in questions], 1,
                                SamplingParams(temperature=0.0, max_tokens=48, seed=0))
    return sum(r.info["tool_calls"] > 0 for r in rollouts) / len(rollouts)


def test_a_few_sft_steps_on_the_shipped_demonstrations_make_smollm2_call_the_tool(smollm2, smollm2_dir, tmp_path):
    from grpolab.algorithms.sft import SFTConfig, train_sft
    from grpolab.data.tasks import get_task
    from grpolab.models import load_model_and_tokenizer

    demos = (ROOT / "configs/real/smollm2_135m_tool_demos.jsonl").read_text(encoding="utf-8").splitlines()
    data = tmp_path / "demos.jsonl"
    data.write_text("\n".join(demos[:ROWS]) + "\n", encoding="utf-8")
    trained = {json.loads(line)["messages"][0]["content"] for line in demos}
    questions = [ex.question for ex in get_task("arithmetic", seed=0, options=TASK_OPTIONS).examples("test", HELD_OUT)]
    assert not trained & set(questions)  # held out: none of the demonstrations' questions

    keys = ("prompt_template", "system_prompt", "env", "learning_rate", "lr_schedule", "warmup_steps")
    final = train_sft(SFTConfig(model=str(smollm2_dir), task=None, train_data=str(data), n_sft_steps=STEPS,
                                train_batch_size=8, gradient_accumulation_steps=1, run_dir=str(tmp_path / "sft"),
                                show_progress=False, device="cpu", **{k: SFT_CONFIG[k] for k in keys})).final_dir
    model, tokenizer = load_model_and_tokenizer(str(final), dtype="float32")
    before, after = call_rate(*smollm2, questions), call_rate(model.eval(), tokenizer, questions)
    assert after > 0 and after > before, (before, after)
