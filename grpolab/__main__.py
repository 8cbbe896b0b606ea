"""``python -m grpolab`` is the ``grpolab`` command."""

from .cli import app

app(prog_name="grpolab")
