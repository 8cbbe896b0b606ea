"""SFT on tool demonstrations in the model's own function-calling format (``env: {tool_format:
chat_template}``, issue 59 item 5): a replayed demonstration has the ids and loss mask of a chat
rollout that wrote the same turns, token for token (a tiny chat model taught on the replays, then
sampled greedily through the environment, writes them); a demonstration with a bad call is one line
naming its row."""

import json

import pytest
import torch

from grpolab.core import build_sequences
from grpolab.data.prompts.chat import ChatTemplate
from grpolab.envs import EnvBackend, build_env, loss_mask_tensor, replay_chat_demonstrations
from grpolab.models.tiny import build_tiny_model
from grpolab.rollout import HFRolloutBackend, SamplingParams
from tests.envs.test_chat_tools import COMPACT_TOOLS
from tests.helpers.chat_models import chat_model_dir, chat_tokenizer
from tests.helpers.teaching import teach

QUESTIONS = {"12+30": "42", "7*6": "42"}


def call(expr: str, name: str = "calculate") -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps({"expression": expr})}}


def conversation(expr: str, answer: str, name: str = "calculate") -> list[dict]:
    """A demonstration as TRL/OpenAI write it; the tool message's content is stale (replaced by the live result)."""
    return [{"role": "user", "content": f"What is {expr}?"},
            {"role": "assistant", "content": "", "tool_calls": [call(expr, name)]},
            {"role": "tool", "content": "stale"}, {"role": "assistant", "content": answer}]


def test_a_replayed_demonstration_is_the_rollout_that_wrote_its_turns():
    tok = chat_tokenizer()
    env = build_env(["calculate"], tokenizer=tok, tool_format="chat_template", chat_template=COMPACT_TOOLS,
                    max_turns=2, max_total_tokens=200)
    convs = [conversation(e, a) for e, a in QUESTIONS.items()]
    demos = replay_chat_demonstrations(env, tok, [c[:1] for c in convs], [c[1:] for c in convs])
    d = demos[0]
    masked = tok.decode([t for t, m in zip(d.response_ids, d.loss_mask) if not m], skip_special_tokens=False)
    assert masked == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"  # the live result, not "stale"
    assert d.tool_calls == 1 and d.response_ids[-1] == tok.eos_token_id and d.loss_mask[-1]
    # a tiny chat model taught on exactly these ids and masks, then sampled greedily through the environment
    model = build_tiny_model("tiny", tok, seed=0)
    batch = build_sequences([x.prompt_ids for x in demos], [x.response_ids for x in demos], tok.pad_token_id)
    mask = batch["response_mask"] & loss_mask_tensor([len(x.prompt_ids) for x in demos],
                                                     [x.loss_mask for x in demos], batch["labels"].shape)
    torch.manual_seed(0)
    teach(model, batch, mask, 150)
    template = ChatTemplate(tok)
    backend = EnvBackend(HFRolloutBackend(model, tok), env, template=template)
    out = backend.generate([template.format(f"What is {e}?") for e in QUESTIONS], 1,
                           SamplingParams(temperature=0.0, max_tokens=100, seed=0))
    for rollout, demo in zip(out, demos):
        assert rollout.info["tool_calls"] == 1 and rollout.info["template_mismatches"] == 0
        assert rollout.prompt_ids == demo.prompt_ids
        assert rollout.response_ids == demo.response_ids  # token for token
        assert rollout.loss_mask == demo.loss_mask


@pytest.mark.parametrize("bad, why", [
    (call("1+1", "calc"), "calls 'calc', which is not one of the tools (calculate)"),
    ({"type": "function", "function": {"name": "calculate", "arguments": '{"expression": 7}'}},
     "calculate: TypeError: argument 'expression' must be string, got integer 7"),
    (call("1/0"), "the call calculate({\"expression\": \"1/0\"}) failed"),
])
def test_a_demonstration_with_a_bad_call_is_one_line_naming_its_row(tmp_path, bad, why):
    from grpolab.algorithms.sft import SFTConfig, train_sft

    rows = [{"messages": conversation("12+30", "42")}, {"messages": conversation("7*6", "42")}]
    rows[1]["messages"][1]["tool_calls"] = [bad]
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = SFTConfig(model=str(chat_model_dir(tmp_path / "m")), task=None, train_data=str(data), n_sft_steps=1,
                    train_batch_size=2, gradient_accumulation_steps=1, warmup_steps=0, prompt_template="chat",
                    env={"tools": ["calculate"], "tool_format": "chat_template", "chat_template": COMPACT_TOOLS,
                         "max_turns": 2, "max_total_tokens": 120},
                    run_dir=str(tmp_path / "sft"), show_progress=False, device="cpu", threads=1)
    with pytest.raises(ValueError) as err:
        train_sft(cfg)
    assert str(err.value).startswith(f"{data}:2: assistant turn 1: ") and why in str(err.value)
    assert "\n" not in str(err.value)
