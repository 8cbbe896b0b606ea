"""Whole test folders that cannot run on a machine: every test in them is skipped with the one
line saying why (shown by ``-ra``), never silently."""

import pytest


def skip_folder(items, folder: str, reason: str | None) -> None:
    """Mark every collected item under ``tests/<folder>/`` skipped with ``reason`` (None: run them)."""
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if f"tests/{folder}/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)
