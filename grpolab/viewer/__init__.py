"""``grpolab view``: a run's curves and per-token records in one self-contained HTML page."""

from .report import ViewError, load_run, make_server, render, write_report

__all__ = ["ViewError", "load_run", "make_server", "render", "write_report"]
