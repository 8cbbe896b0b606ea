"""``python -m grpolab.cli``."""

from . import main

main()
