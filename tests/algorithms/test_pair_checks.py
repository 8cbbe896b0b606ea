"""SFT, DPO and reward-model pairs are rendered, tokenised and checked against the model's context
before the run directory is touched (a finished run kept under --overwrite), once; a response's
end token when the tokenizer has none; a reward model trained on the texts it will score."""

import json

import pytest

from grpolab.algorithms.dpo import DPOConfig, train_dpo
from grpolab.algorithms.rm import RMConfig, pair_token_ids, train_rm
from grpolab.algorithms.sft import SFTConfig, response_eos_id, tokenize_pairs, train_sft
from grpolab.data import DataError, SFTPair, TemplateError
from grpolab.models import build_tiny_model, load_tokenizer
from grpolab.rewards import reward_model_text
from grpolab.training.inputs import load_inputs, load_preference_inputs
from tests.helpers.chat_models import chat_model_dir, chat_tokenizer

FAST = dict(show_progress=False, device="cpu", threads=1)
LONG = "7" * 600  # the embedded models' context is 512 tokens, a character each


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _sft(tmp_path, data, **kw):
    return SFTConfig(task=None, train_data=data, n_sft_steps=1, train_batch_size=2, gradient_accumulation_steps=1,
                     warmup_steps=0, run_dir=str(tmp_path / "sft"), **FAST, **kw)


def test_an_sft_sequence_past_the_context_is_refused_before_the_run_dir(tmp_path, capsys):  # CH20, CH21
    data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q: 1\nA: ", "response": "1"},
                                           {"prompt": "Q: 2\nA: ", "response": LONG},
                                           {"prompt": "Q: 3\nA: ", "response": "3"}])
    with pytest.raises(DataError, match=r"sft.jsonl:2: the SFT sequence is 609 tokens \(prompt 8 \+ response 601\), "
                                        r"past the model's context of 512 tokens"):
        train_sft(_sft(tmp_path, data))
    assert not (tmp_path / "sft" / "config.yaml").exists()
    result = train_sft(_sft(tmp_path, data, data_on_error="skip"))
    assert result.n_examples == 2 and "skipped 1 SFT sequence(s)" in capsys.readouterr().err


def test_a_long_conversation_is_refused_at_once(tmp_path):  # CH20: tokenised once, refused before training
    msgs = [{"role": "user", "content": "x" * 100_000}, {"role": "assistant", "content": "y"}]
    model_dir = str(chat_model_dir(tmp_path / "m"))
    data = _jsonl(tmp_path / "conv.jsonl", [{"messages": msgs}])
    with pytest.raises(DataError, match=r"conv.jsonl:1: the SFT sequence is \d+ tokens \(prompt \d+ \+ response 2\)"):
        train_sft(_sft(tmp_path, data, model=model_dir))


HISTORY = (  # Qwen3-style: an earlier assistant turn is rendered without its content
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '...' }}{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_overwrite_keeps_a_finished_run_when_the_pairs_cannot_be_rendered(tmp_path):  # CH23
    run_dir = tmp_path / "sft"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "model.safetensors").write_text("the finished run")
    (run_dir / "metrics.jsonl").write_text('{"train_step": 0}\n')
    tok = chat_tokenizer()
    tok.chat_template = HISTORY
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    data = _jsonl(tmp_path / "multi.jsonl", [{"messages": msgs}])
    with pytest.raises(TemplateError) as refused:
        train_sft(_sft(tmp_path, data), model=build_tiny_model("tiny", tokenizer=tok), tokenizer=tok, overwrite=True)
    assert (run_dir / "final" / "model.safetensors").read_text() == "the finished run"
    assert (run_dir / "metrics.jsonl").read_text() == '{"train_step": 0}\n'
    assert "multi.jsonl:1: the chat template renders a conversation's prefix differently" in str(refused.value)


def test_a_system_prompt_too_long_for_the_context_is_blamed_on_it_in_sft(tmp_path):  # CH14
    (tmp_path / "sys_long.txt").write_text("x" * 600)
    data = _jsonl(tmp_path / "pc.jsonl", [{"prompt": [{"role": "user", "content": "1+1"}], "completion": "2"}])
    cfg = _sft(tmp_path, data, model=str(chat_model_dir(tmp_path / "m")), system_prompt=str(tmp_path / "sys_long.txt"))
    with pytest.raises(TemplateError, match=r"sys_long.txt: the system prompt makes every prompt at least \d+ tokens, "
                                            r"past the model's context of 512 tokens: shorten the system prompt"):
        train_sft(cfg)


def test_a_system_prompt_too_long_for_the_context_is_blamed_on_it_in_grpo(tmp_path, grpo_config):  # CH14
    from grpolab.algorithms.grpo import train_grpo

    (tmp_path / "sys_long.txt").write_text("x" * 500)  # fits alone, not with 6 tokens to sample
    cfg = grpo_config(model=str(chat_model_dir(tmp_path / "m")), prompt_template="chat",
                      system_prompt=str(tmp_path / "sys_long.txt"))
    with pytest.raises(TemplateError, match=r"sys_long.txt: the system prompt makes every prompt at least \d+ tokens; "
                                            r"with sampling_max_tokens 6 that exceeds the model's context of 512"):
        train_grpo(cfg)
    assert not (tmp_path / "run").exists()


def test_append_eos_without_an_eos_uses_the_generation_config_or_refuses():  # CH17
    tok = chat_tokenizer()
    tok.eos_token = None
    with pytest.raises(ValueError, match="append_eos: the tokenizer has no eos token"):  # not a response without one
        tokenize_pairs([SFTPair("q", "r")], tok, append_eos=True)
    model = build_tiny_model("tiny", tokenizer=chat_tokenizer())
    model.generation_config.eos_token_id = [7, 8]
    assert response_eos_id(tok, model) == 7
    (_, response, _), = tokenize_pairs([SFTPair("q", "r")], tok, append_eos=True, eos_id=response_eos_id(tok, model))
    assert response[-1] == 7
    model.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="no eos token and the model's generation_config names none"):
        response_eos_id(tok, model)
    (_, kept, _), = tokenize_pairs([SFTPair("q", "r")], tok, append_eos=False)  # responses as given: no eos needed
    assert kept == tok("r", add_special_tokens=False)["input_ids"]


def test_a_dpo_pair_past_the_context_is_refused_before_the_run_dir(tmp_path):  # CH20 for DPO
    records = [{"prompt": f"say {i}", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(9)]
    data = _jsonl(tmp_path / "pref.jsonl", [*records, {"prompt": "say", "chosen": LONG, "rejected": "no"}])
    cfg = DPOConfig(task=None, train_data=data, eval_data=data, n_dpo_steps=1, train_batch_size=2,
                    run_dir=str(tmp_path / "dpo"), **FAST)
    with pytest.raises(DataError, match=r"pref.jsonl:10: the preference pair is 604 tokens \(prompt 3 \+ the longer "
                                        r"response 601\), past the model's context of 512 tokens"):
        train_dpo(cfg)
    assert not (tmp_path / "dpo" / "config.yaml").exists()


def test_a_reward_model_text_past_the_context_is_refused_unless_truncated(tmp_path):  # CH20 for RM
    records = [{"prompt": f"say {i}", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(9)]
    data = _jsonl(tmp_path / "pref.jsonl", [*records, {"prompt": "say", "chosen": LONG, "rejected": "no"}])
    common = dict(task=None, train_data=data, eval_data=data, n_rm_steps=1, train_batch_size=2, **FAST)
    with pytest.raises(DataError, match=r"pref.jsonl:10: the preference pair is 603 tokens \(chosen 603, rejected 5, "
                                        r"truncated to max_length 1024\), past the model's context of 512 tokens"):
        train_rm(RMConfig(**common, run_dir=str(tmp_path / "rm")))
    assert not (tmp_path / "rm" / "config.yaml").exists()
    train_rm(RMConfig(**common, max_length=256, run_dir=str(tmp_path / "rm256")))  # truncated from the left: fits


def test_the_reward_model_trains_on_the_text_scoring_reads(tmp_path):  # F2
    from grpolab.algorithms.grpo import GRPOConfig

    model_dir = str(chat_model_dir(tmp_path / "m"))
    tok = load_tokenizer(model_dir)
    cfg = RMConfig(model=model_dir, task="arithmetic", task_train_size=2, eval_pairs=1, chat_template=True)
    pair = load_preference_inputs(cfg, tok)[0][0]
    (chosen, _), = pair_token_ids(tok, [pair], cfg)
    grpo = load_inputs(GRPOConfig(model=model_dir, task="arithmetic", task_train_size=2, eval_examples=1), tok)
    example = next(e for e in grpo.train if grpo.template.format(e.question) == pair.prompt)
    # what reward: {model, chat_template: true} scores (RewardModel.raw_scores): the raw question as the user turn
    scored = reward_model_text(tok, grpo.template.format(example.question), pair.chosen, example.question, True)
    assert tok.decode(chosen) == scored and scored.startswith(f"<|im_start|>user\n{example.question}<|im_end|>")


def test_a_directory_that_is_not_a_model_is_said_the_same_by_every_trainer(tmp_path):  # RM15
    from grpolab.models import ModelLoadError

    (tmp_path / "notamodel").mkdir()
    cfg = RMConfig(model=str(tmp_path / "notamodel"), task="arithmetic", n_rm_steps=1, run_dir=str(tmp_path / "rm"),
                   **FAST)
    with pytest.raises(ModelLoadError, match=r"no config.json in .*notamodel: not a Hugging Face model directory"):
        train_rm(cfg)
    assert not (tmp_path / "rm").exists()


def test_dpo_prompts_from_a_file_get_the_runs_system_prompt_and_an_eos(tmp_path):  # F1 and CH17 for DPO
    from grpolab.algorithms.dpo import pair_token_ids

    model_dir = str(chat_model_dir(tmp_path / "m"))
    conv = [{"role": "user", "content": "1+1"}]
    data = _jsonl(tmp_path / "prefs.jsonl", [{"prompt": conv, "chosen": "2", "rejected": "3"},
                                             {"prompt": "2+2", "chosen": "4", "rejected": "5"}])
    cfg = DPOConfig(task=None, train_data=data, eval_data=data, n_dpo_steps=1, train_batch_size=2,
                    model=model_dir, run_dir=str(tmp_path / "dpo"), system_prompt="Be brief.", **FAST)
    train, _ = load_preference_inputs(cfg, render_prompts=True)
    tok = load_tokenizer(model_dir)
    for pair in train:  # both kinds of prompt, as GRPO and SFT render them: the system message first
        assert isinstance(pair.prompt, str) and pair.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
        assert pair.prompt.endswith("<|im_start|>assistant\n")
    (_, chosen, _), _ = pair_token_ids(tok, train, alpaca=False)
    assert chosen[-1] == tok.eos_token_id
    with pytest.raises(TemplateError, match="use_alpaca_template and prompt_template/system_prompt"):
        load_preference_inputs(cfg.model_copy(update={"use_alpaca_template": True}), render_prompts=True)
    tok.eos_token = None
    model = build_tiny_model("tiny", tokenizer=tok)
    with pytest.raises(ValueError, match="DPO ends each response with the tokenizer's eos token"):
        train_dpo(cfg, model=model, tokenizer=tok)
    assert not (tmp_path / "dpo").exists()
