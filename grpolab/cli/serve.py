"""``grpolab serve MODEL_DIR``: a model as an OpenAI/vLLM-compatible endpoint on 127.0.0.1
(``envs.chat_server.ChatServer`` over the HF sampler)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from .base import _fail, _quiet_hf, _user_errors, app


@app.command()
def serve(
    model: str = typer.Argument(..., help="A model directory (a run's final/ or checkpoints/step_N/, any Hugging "
                                          "Face directory) or embedded:tiny|small."),
    port: int = typer.Option(8000, "--port", help="The port on 127.0.0.1 (0: any free one)."),
    host: str = typer.Option("127.0.0.1", "--host", help="127.0.0.1 or localhost only: the endpoint runs the model "
                                                         "unguarded, so it never listens beyond this machine."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template",
                                                help="hermes (ChatML with tools), a Jinja file, or the template's "
                                                     "text, in place of the tokenizer's own."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="The name /v1/models gives (default: MODEL as given)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="The most tokens a request may ask for "
                                                                        "(default: the model's context)."),
    max_n: int = typer.Option(16, "--max-n", help="The most completions (n) one request may ask for."),
    max_body_mb: float = typer.Option(8.0, "--max-body-mb", help="The largest request body, in MiB."),
    max_in_flight: int = typer.Option(1024, "--max-in-flight",
                                      help="Requests served at once; more are answered 503."),
    max_exchanges: int = typer.Option(16384, "--max-exchanges",
                                      help="Completions kept for exact-id multi-turn chaining (the oldest dropped)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="GRPOLAB_API_KEY",
                                          help="Require Authorization: Bearer KEY on every route but /health."),
    logprobs_mode: str = typer.Option("raw_logprobs", "--logprobs-mode",
                                      help="raw_logprobs (the model's, as vLLM's default) or processed_logprobs "
                                           "(the sampler's, at the request's temperature and top-p)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    seed: int = typer.Option(0, "--seed", help="The seed of requests that give none."),
) -> None:
    """Serve a model: /v1/chat/completions (streamed or not, tools), /v1/completions, /v1/models,
    /health, /tokenize, /detokenize, on 127.0.0.1 until Ctrl-C or SIGTERM."""
    _quiet_hf()
    import torch

    from ..envs.chat_server import ChatServer
    from ..models.loading import load_model_and_tokenizer
    from ..rollout import HFRolloutBackend

    try:
        if not 0 <= port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {port}")
        for name, value in (("--max-n", max_n), ("--max-in-flight", max_in_flight),
                            ("--max-exchanges", max_exchanges), ("--max-tokens", max_tokens or 1)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not max_body_mb > 0:
            raise ValueError(f"--max-body-mb must be > 0, got {max_body_mb}")
        template = chat_template
        if template is not None and template != "hermes" and "{" not in template:
            path = Path(template)
            if not path.is_file():
                raise FileNotFoundError(f"--chat-template {template}: no such file (give hermes, a Jinja file or "
                                        "the template's text)")
            template = path.read_text(encoding="utf-8")
        net, tok = load_model_and_tokenizer(model, dtype=dtype)
        net.eval()
        server = ChatServer(HFRolloutBackend(net, tok, generator=torch.Generator().manual_seed(seed)), tok,
                            chat_template=template, port=port, host=host, max_tokens=max_tokens, max_n=max_n,
                            max_body_bytes=int(max_body_mb * 2**20), max_in_flight=max_in_flight,
                            max_exchanges=max_exchanges, api_key=api_key, logprobs_mode=logprobs_mode,
                            model_name=served_model_name or model)
    except OSError as exc:
        if isinstance(exc, (FileNotFoundError, NotADirectoryError, PermissionError)):
            _fail(str(exc))
        _fail(f"--port {port}: cannot listen on 127.0.0.1 ({exc.strerror or exc})")
    except _user_errors() as exc:
        _fail(str(exc))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with server:
        typer.echo(f"serving {server.url} (model {server.model_name}, context {server.context} tokens; "
                   "Ctrl-C to stop)")
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
    typer.echo("stopped")
