"""Conversational data and chat prompts that must not pass silently: a message object where a list
belongs, a prompt with no user turn, empty assistant turns, mixed text and conversation prompts,
a system prompt path with a typo, a chat template file that is a directory, a system prompt too
long for the context, and what SFT on ``{messages}`` makes of the system prompt and a named preset."""

import json

import pytest

from grpolab.algorithms.grpo import GRPOConfig
from grpolab.algorithms.sft import SFTConfig, tokenize_pairs
from grpolab.data import DataError, TemplateError, load_examples, load_preferences, load_sft_pairs, load_template
from grpolab.data.prompts.chat import check_system_prompt_fits, has_chat_template, read_system_prompt
from grpolab.models import load_tokenizer
from grpolab.training.inputs import load_inputs, load_sft_inputs
from tests.helpers.chat_models import chat_model_dir, chat_tokenizer

IM_S, IM_E = "<|im_start|>", "<|im_end|>"
USER, SYSTEM = {"role": "user", "content": "2+3?"}, {"role": "system", "content": "S"}


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(chat_model_dir(tmp_path_factory.mktemp("chat") / "m"))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_prompt_given_as_one_message_object_names_the_line(tmp_path):  # CH03
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "ok", "answer": "1"}, {"prompt": USER, "answer": "5"}])
    with pytest.raises(DataError, match=r"d.jsonl:2: field 'prompt' is one message object; a conversation is a list"):
        load_examples(path)
    with pytest.raises(DataError, match=r"s.jsonl:1: field 'prompt' is one message object"):
        load_sft_pairs(_jsonl(tmp_path / "s.jsonl", [{"prompt": USER, "completion": "5"}]))
    with pytest.raises(DataError, match=r"p.jsonl:1: field 'prompt' is one message object"):
        load_preferences(_jsonl(tmp_path / "p.jsonl", [{"prompt": USER, "chosen": "5", "rejected": "6"}]))


def test_a_boolean_prompt_names_the_line(tmp_path):  # true asks nothing; a number may be a question
    with pytest.raises(DataError, match=r"b.jsonl:1: field 'prompt' is true; expected text or a list of messages"):
        load_examples(_jsonl(tmp_path / "b.jsonl", [{"prompt": True, "answer": "1"}]))
    assert load_examples(_jsonl(tmp_path / "n.jsonl", [{"prompt": 12, "answer": "12"}]))[0].question == "12"


def test_a_system_prompt_path_that_is_not_a_regular_file_says_so():
    with pytest.raises(TemplateError, match="system_prompt '/dev/zero' looks like a file path but is not a regular"):
        read_system_prompt("/dev/zero")


def test_a_system_only_prompt_is_refused_as_under_messages(tmp_path):  # CH04 (CH05: messages)
    with pytest.raises(DataError, match=r"d.jsonl:1: field 'prompt' has no user message"):
        load_examples(_jsonl(tmp_path / "d.jsonl", [{"prompt": [SYSTEM], "answer": "5"}]))
    with pytest.raises(DataError, match=r"m.jsonl:1: field 'messages' has no user message"):
        load_examples(_jsonl(tmp_path / "m.jsonl", [{"messages": [SYSTEM], "answer": "5"}]))


def test_mixed_text_and_conversation_questions_are_said_once(tmp_path):  # CH06
    records = [{"question": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4"},
               {"prompt": [USER], "answer": "5"}, {"prompt": [USER], "answer": "5"}]
    with pytest.warns(UserWarning, match=r"mix.jsonl: mixes text questions \(first at line 1\) and conversations "
                                         r"\(first at line 3\)") as record:
        load_examples(_jsonl(tmp_path / "mix.jsonl", records))
    assert len([w for w in record if "mixes" in str(w.message)]) == 1


def test_empty_assistant_turns_are_refused_like_an_empty_response(tmp_path):  # CH18
    msgs = [USER, {"role": "assistant", "content": " "}]
    with pytest.raises(DataError, match=r"e.jsonl:1: field 'messages': message 1 is an empty assistant turn"):
        load_sft_pairs(_jsonl(tmp_path / "e.jsonl", [{"messages": msgs}]))
    with pytest.raises(DataError, match=r"c.jsonl:1: empty field 'completion'"):
        load_sft_pairs(_jsonl(tmp_path / "c.jsonl", [{"prompt": [USER], "completion": [msgs[1]]}]))
    with pytest.raises(DataError, match=r"r.jsonl:1: empty field 'response'"):  # as a plain pair always was
        load_sft_pairs(_jsonl(tmp_path / "r.jsonl", [{"prompt": "q", "response": " "}]))


def test_chat_prompts_on_a_tokenizer_without_a_chat_template_say_so():  # CH09
    with pytest.raises(TemplateError, match=r"prompt_template 'chat': the tokenizer \(\w+\) has no chat template; "
                                            "use a text template"):
        load_inputs(GRPOConfig(model="embedded:tiny", prompt_template="chat", task_train_size=2, eval_examples=1))


def test_a_chat_template_file_that_is_a_directory_is_named(tmp_path, model_dir):  # CH11
    import shutil

    broken = tmp_path / "tc_dir"
    shutil.copytree(model_dir, broken)
    (broken / "chat_template.jinja").unlink(missing_ok=True)
    (broken / "chat_template.jinja").mkdir()
    for name in ("tokenizer_config.json",):  # the template may also be kept in the tokenizer's config
        config = json.loads((broken / name).read_text())
        config.pop("chat_template", None)
        (broken / name).write_text(json.dumps(config))
    tok = load_tokenizer(str(broken))
    with pytest.raises(TemplateError, match=r"tc_dir/chat_template.jinja: is not a file, so the tokenizer has no chat"):
        has_chat_template(tok)
    # text data on the embedded task: no quiet fall back to the task's text template either
    with pytest.raises(TemplateError, match=r"chat_template.jinja: is not a file"):
        load_inputs(GRPOConfig(model=str(broken), task_train_size=2, eval_examples=1))


@pytest.mark.parametrize("value, problem", [("tpl/sys_typo.txt", "no such file"), ("notes.md", "no such file"),
                                            ("my prompts/system.txt", "no such file")])
def test_a_system_prompt_path_that_is_no_file_is_refused(value, problem):  # CH15
    with pytest.raises(TemplateError, match=rf"system_prompt '{value}' looks like a file path but {problem}"):
        read_system_prompt(value)


def test_a_system_prompt_directory_is_refused_and_prose_is_text(tmp_path, tok):  # CH15
    with pytest.raises(TemplateError, match="looks like a file path but is a directory"):
        load_template("chat", tokenizer=tok, system_prompt=str(tmp_path))
    for text in ("Answer in km/h.", "You are a calculator. Reply with only the result.", "Be brief"):
        assert read_system_prompt(text) == text


def test_a_system_prompt_too_long_for_the_context_is_blamed_on_it(tmp_path, tok):  # CH14
    (tmp_path / "sys_long.txt").write_text("x" * 600)
    chat = load_template("chat", tokenizer=tok, system_prompt=str(tmp_path / "sys_long.txt"))
    with pytest.raises(TemplateError, match=r"sys_long.txt: the system prompt makes every prompt at least \d+ tokens; "
                                            r"with sampling_max_tokens 16 that exceeds the model's context of 512"):
        check_system_prompt_fits(chat, tok, 512, 16, "sampling_max_tokens")
    check_system_prompt_fits(load_template("chat", tokenizer=tok, system_prompt="Be brief."), tok, 512, 16)


def test_sft_messages_get_the_system_prompt(tmp_path, model_dir):  # F1
    msgs = [USER, {"role": "assistant", "content": "5"}]
    data = _jsonl(tmp_path / "sft.jsonl", [{"messages": msgs}])
    tok = load_tokenizer(model_dir)
    pairs, inputs = load_sft_inputs(SFTConfig(model=model_dir, task=None, train_data=data, system_prompt="Be brief."))
    (p_ids, _, _), = tokenize_pairs(pairs, tok, append_eos=True)
    assert tok.decode(p_ids) == f"{IM_S}system\nBe brief.{IM_E}\n{IM_S}user\n2+3?{IM_E}\n{IM_S}assistant\n"
    assert inputs.template.format([USER]) == tok.decode(p_ids)  # as a conversation question of the run renders
    own = _jsonl(tmp_path / "own.jsonl", [{"messages": [SYSTEM, *msgs]}])  # a conversation's own system message stays
    pairs, _ = load_sft_inputs(SFTConfig(model=model_dir, task=None, train_data=own, system_prompt="Be brief."))
    assert pairs[0].messages[0] == SYSTEM and len(pairs[0].messages) == 3


def test_sft_messages_under_a_named_preset_that_wraps_are_refused(tmp_path, model_dir):  # F1
    data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "q", "response": "r"},
                                           {"messages": [USER, {"role": "assistant", "content": "5"}]}])
    with pytest.raises(DataError, match=r"sft.jsonl:2: prompt_template 'chat_r1' wraps a question in its instruction"):
        load_sft_inputs(SFTConfig(model=model_dir, task=None, train_data=data, prompt_template="chat_r1"))
    pairs, _ = load_sft_inputs(SFTConfig(model=model_dir, task=None, train_data=data, prompt_template="chat"))
    assert pairs[1].messages[0] == USER  # chat adds nothing: the conversation as it is
