"""``python -m grpolab`` is the ``grpolab`` command."""

from .cli import main

main()
