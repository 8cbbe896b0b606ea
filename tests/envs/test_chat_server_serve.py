"""Issue 58 item 3: ``grpolab serve MODEL_DIR`` serves a saved model as a process of its own — /health,
/v1/models (a complete model object), /tokenize and /detokenize, /v1/completions (text or token ids,
streamed or not) and /v1/chat/completions with the Hermes template — and stops on SIGTERM; a bad option is
one line and exit 2."""

import json
import os
import signal
import subprocess
import sys
import urllib.request

import openai

from grpolab.envs.chat_tools import HERMES_TEMPLATE
from tests.helpers.chat_models import chat_model_dir, chat_tokenizer

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}


def _get(url):
    with urllib.request.urlopen(url, timeout=60) as resp:
        return resp.status, json.loads(resp.read() or b"{}")


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read().decode()


def test_grpolab_serve_answers_every_route_and_stops_on_sigterm(tmp_path):
    model = chat_model_dir(tmp_path / "final")
    proc = subprocess.Popen([sys.executable, "-m", "grpolab", "serve", str(model), "--port", "0", "--chat-template",
                             "hermes", "--served-model-name", "mine"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        url = line.split()[1]
        root = url[: -len("/v1")]
        assert _get(root + "/health")[0] == 200
        listed = _get(url + "/models")[1]["data"]
        assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in listed] == \
            [("mine", "model", "grpolab", 512)] and isinstance(listed[0]["created"], int)
        tok = chat_tokenizer()
        tokens = json.loads(_post(root + "/tokenize", {"prompt": "2+3="}))
        assert tokens["tokens"] == tok("2+3=", add_special_tokens=False)["input_ids"] and tokens["count"] == 4
        assert json.loads(_post(root + "/detokenize", {"tokens": tokens["tokens"]}))["prompt"] == "2+3="
        done = json.loads(_post(url + "/completions", {"prompt": "2+3=", "max_tokens": 5, "seed": 0}))
        assert done["object"] == "text_completion" and done["choices"][0]["text"]
        assert done["usage"]["prompt_tokens"] == 4
        by_ids = json.loads(_post(url + "/completions", {"prompt": tokens["tokens"], "max_tokens": 5, "seed": 0}))
        assert by_ids["choices"][0]["token_ids"] == done["choices"][0]["token_ids"]
        events = _post(url + "/completions", {"prompt": "2+3=", "max_tokens": 5, "seed": 0, "stream": True})
        chunks = [json.loads(e[len("data: "):]) for e in events.split("\n\n") if e.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == done["choices"][0]["text"]
        assert events.rstrip().endswith("data: [DONE]")
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is 2+3?"}]
        answer = client.chat.completions.create(model="mine", messages=messages, max_tokens=4)
        text = tok.apply_chat_template(messages, chat_template=HERMES_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)
        assert answer.prompt_token_ids == tok(text, add_special_tokens=False)["input_ids"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.strip().endswith("stopped"), (out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_grpolab_serve_refuses_a_public_host_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grpolab", "serve", "embedded:tiny", "--host", "0.0.0.0"],
                          capture_output=True, text=True, env=ENV, timeout=240)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["grpolab: error: the chat endpoint listens on 127.0.0.1 only, not "
                                                "'0.0.0.0': it runs the policy unguarded"]
