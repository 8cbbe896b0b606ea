"""Chat models: prompts rendered by the tokenizer's chat template, conversational data in every
loader, SFT on conversations (assistant tokens only) and the eos appended to responses."""

import contextlib
import json

import pytest
import torch

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.algorithms.sft import SFTConfig, tokenize_pairs
from grpolab.data import (
    ChatTemplate,
    DataError,
    SFTPair,
    TemplateError,
    conversation_segments,
    get_task,
    load_examples,
    load_preferences,
    load_sft_pairs,
    load_template,
)
from grpolab.rewards import BUILTIN_REWARDS
from grpolab.training.batching import accumulate_sft_gradient
from grpolab.training.inputs import load_inputs, load_sft_inputs, prompt_template_for, task_or_file
from tests.helpers.chat_models import chat_model_dir, chat_tokenizer

IM_S, IM_E = "<|im_start|>", "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_chat_preset_renders_the_tokenizers_template(tok):
    chat = load_template("chat", tokenizer=tok)
    assert chat.format("2+3") == f"{IM_S}user\n2+3{IM_E}\n{IM_S}assistant\n"
    with_system = load_template("chat", tokenizer=tok, system_prompt="Be brief.")
    assert with_system.format("2+3") == f"{IM_S}system\nBe brief.{IM_E}\n{IM_S}user\n2+3{IM_E}\n{IM_S}assistant\n"
    r1 = load_template("chat_r1", tokenizer=tok)
    prompt = r1.format("2+3")
    # the question and the R1 instruction in the user turn; the assistant's turn opens with <think>
    assert prompt.startswith(f"{IM_S}user\n2+3\n\n") and "<answer> </answer>" in prompt
    assert prompt.endswith(f"{IM_E}\n{IM_S}assistant\n<think>")


def test_system_prompt_from_a_file_and_a_conversation_question(tok, tmp_path):
    (tmp_path / "system.txt").write_text("You add numbers.\n")
    chat = load_template("chat", tokenizer=tok, system_prompt=str(tmp_path / "system.txt"))
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "1+1"}]
    assert chat.format(convo) == (f"{IM_S}system\nYou add numbers.\n{IM_E}\n{IM_S}user\nhi{IM_E}\n"
                                  f"{IM_S}assistant\nhello{IM_E}\n{IM_S}user\n1+1{IM_E}\n{IM_S}assistant\n")
    # a conversation that has its own system message keeps it
    own = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert chat.format(own).startswith(f"{IM_S}system\nS{IM_E}")


def test_chat_refusals(char_tokenizer, tok):
    with pytest.raises(TemplateError, match="has no chat template"):
        load_template("chat", tokenizer=char_tokenizer)
    with pytest.raises(TemplateError, match="needs the model's tokenizer"):
        load_template("chat_r1")
    with pytest.raises(TemplateError, match="system_prompt needs a chat template"):
        load_template("compact", system_prompt="x")
    with pytest.raises(TemplateError, match="needs a chat template"):
        load_template("compact").format([{"role": "user", "content": "q"}])


def test_default_template_follows_the_tokenizer(tok, char_tokenizer, capsys):
    # a chat tokenizer and a reward that reads <answer> tags (the task's): chat_r1, said in one line
    examples, template, reward = task_or_file("task:arithmetic", 3, tokenizer=tok)
    assert isinstance(template, ChatTemplate) and template.name == "chat_r1"
    assert "prompts use it (prompt_template: chat_r1)" in capsys.readouterr().err
    # ... with the task's verifier in its lenient form: a chat model's newline before <answer> is no format failure
    assert reward is BUILTIN_REWARDS["arithmetic_lenient"]
    assert reward("1+2=3</think>\n<answer>3</answer>", "3")["reward"] == 1.0
    assert BUILTIN_REWARDS["arithmetic"]("1+2=3</think>\n<answer>3</answer>", "3")["reward"] == 0.0
    # a tag-free reward: plain chat
    _, plain, _ = task_or_file("task:arithmetic", 3, tokenizer=tok, reward="question_only")
    assert plain.name == "chat" and plain.format("1+1") == f"{IM_S}user\n1+1{IM_E}\n{IM_S}assistant\n"
    # the embedded character tokenizer has no chat template: the task's own template, as before
    _, compact, r = task_or_file("task:arithmetic", 3, tokenizer=char_tokenizer)
    assert compact.text == load_template("compact").text and r is get_task("arithmetic").reward_fn
    # an explicit template wins
    _, given, _ = task_or_file("task:arithmetic", 3, tokenizer=tok, prompt_template="compact")
    assert given.text == load_template("compact").text


def test_a_chat_model_directory_gets_chat_prompts_from_its_config(tmp_path):
    model_dir = chat_model_dir(tmp_path / "m")
    inputs = load_inputs(GRPOConfig(model=str(model_dir), task_train_size=4, eval_examples=2))
    assert inputs.template.name == "chat_r1"
    assert inputs.template.format(inputs.train[0].question).startswith(f"{IM_S}user\n{inputs.train[0].question}")
    sys_inputs = load_inputs(GRPOConfig(model=str(model_dir), task_train_size=4, eval_examples=2,
                                        prompt_template="chat", system_prompt="S"))
    assert sys_inputs.template.format("q") == f"{IM_S}system\nS{IM_E}\n{IM_S}user\nq{IM_E}\n{IM_S}assistant\n"


def test_conversational_records_in_every_loader(tmp_path):
    convo = [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1?"}]
    with pytest.warns(UserWarning, match="mixes text questions"):  # said once (tests/data/test_chat_refusals.py)
        ex = load_examples(_jsonl(tmp_path / "q.jsonl", [{"prompt": convo, "answer": "2"},
                                                          {"question": "plain", "answer": "3"}]))
    assert ex[0].question == convo and ex[1].question == "plain"
    msgs = convo + [{"role": "assistant", "content": "2"}]
    ex = load_examples(_jsonl(tmp_path / "m.jsonl", [{"messages": msgs, "answer": "2"}]))
    assert ex[0].question == convo  # the prompt is up to the last user message
    pairs = load_sft_pairs(_jsonl(tmp_path / "s.jsonl", [
        {"prompt": "p", "response": "r"},
        {"prompt": convo, "completion": [{"role": "assistant", "content": "2"}]},
        {"messages": msgs}]))
    assert (pairs[0].prompt, pairs[0].response) == ("p", "r")
    assert (pairs[1].prompt, pairs[1].response) == (convo, "2")
    assert pairs[2].messages == msgs and pairs[2].response is None
    prefs = load_preferences(_jsonl(
                                 tmp_path / "d.jsonl",
                                 [{"prompt": convo, "chosen": [{"role": "assistant", "content": "2"}],
                                   "rejected": [{"role": "assistant", "content": "3"}]}],
                             ))
    assert (prefs[0].prompt, prefs[0].chosen, prefs[0].rejected) == (convo, "2", "3")


@pytest.mark.parametrize("record, problem", [
    ({"prompt": [{"role": "user"}], "answer": "1"}, "message 0 is not a {role, content} object"),
    ({"prompt": [{"role": "wizard", "content": "x"}], "answer": "1"}, "needs a role"),
    ({"prompt": [], "answer": "1"}, "non-empty list"),
    ({"messages": [{"role": "assistant", "content": "x"}], "answer": "1"}, "has no user message"),
])
def test_bad_conversations_name_the_file_and_line(tmp_path, record, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "ok", "answer": "1"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{problem.replace('{', '.').replace('}', '.')}"):
        load_examples(str(path))


def test_sft_messages_train_only_the_assistant_turns(tok):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "dd"}]
    prompt, pieces = conversation_segments(tok, msgs)
    assert prompt == f"{IM_S}user\na{IM_E}\n{IM_S}assistant\n"
    # the pieces are exactly the rest of the whole conversation's render (less the glue after the last turn)
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert prompt + "".join(t for t, _ in pieces) + "\n" == full
    assert [t for t, trained in pieces if trained] == [f"b{IM_E}", f"dd{IM_E}"]
    (p_ids, r_ids, mask), = tokenize_pairs([SFTPair(msgs[:1], None, messages=msgs)], tok, append_eos=True)
    trained = [i for i, m in zip(r_ids, mask) if m]
    eos = tok.eos_token_id
    assert trained == tok("b", add_special_tokens=False)["input_ids"] + [eos] + \
        tok("dd", add_special_tokens=False)["input_ids"] + [eos]
    assert r_ids[-1] == eos and sum(1 for i in r_ids if i == eos) == 3  # the user turn's end is not trained
    # the SFT gradient covers exactly those tokens: equal to a hand-written NLL over them
    from grpolab.core import pad_token_id
    from grpolab.models import build_tiny_model

    model = build_tiny_model("tiny", tokenizer=tok, seed=0)
    accumulate_sft_gradient(model, [(p_ids, r_ids, mask)], 1, 1.0, pad_token_id(tok), "cpu", contextlib.nullcontext)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ids = torch.tensor([p_ids + r_ids])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    keep = torch.tensor([False] * (len(p_ids) - 1) + mask)
    (-(logp.gather(1, targets[:, None])[:, 0][keep]).sum()).backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_sft_appends_eos_once(tok):
    eos = tok.eos_token_id
    (_, plain, mask), (_, ended, _) = tokenize_pairs(
        [SFTPair("q", "The answer is 2."), SFTPair("q", f"The answer is 2.{IM_E}")], tok, append_eos=True)
    assert (mask is None
            and plain[-1] == eos
            and plain[:-1] == tok("The answer is 2.", add_special_tokens=False)["input_ids"])
    assert ended == plain  # a response that already ends with eos gets no second one
    (_, kept, _), = tokenize_pairs([SFTPair("q", "The answer is 2.")], tok, append_eos=False)
    assert eos not in kept


def test_sft_pairs_prompts_verbatim_unless_a_template_is_given(tmp_path):
    model_dir = chat_model_dir(tmp_path / "m")
    data = _jsonl(tmp_path / "sft.jsonl", [
        {"prompt": "Q: 1+1\nA: <think>", "response": "1+1=2</think> <answer>2</answer>"},
        {"prompt": [{"role": "user", "content": "2+2"}], "completion": "4"}])
    pairs, inputs = load_sft_inputs(SFTConfig(model=str(model_dir), task=None, train_data=data))
    assert pairs[0].prompt == "Q: 1+1\nA: <think>"  # CS336's sft.jsonl holds formatted prompts
    assert pairs[1].prompt == f"{IM_S}user\n2+2{IM_E}\n{IM_S}assistant\n"  # a conversation is rendered
    pairs, _ = load_sft_inputs(SFTConfig(model=str(model_dir), task=None, train_data=data, prompt_template="chat"))
    assert pairs[0].prompt == f"{IM_S}user\nQ: 1+1\nA: <think>{IM_E}\n{IM_S}assistant\n"


def test_prompt_template_for_is_the_one_place(tok):
    task = get_task("arithmetic")
    assert prompt_template_for(task, None, tokenizer=tok).name == "chat_r1"
    assert prompt_template_for(task, None).text == load_template("compact").text
