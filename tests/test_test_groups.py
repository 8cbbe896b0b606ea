"""make test's module groups (tests/conftest.py) hold under the installed pytest and pytest-xdist.

A module whose tests use a module-scoped fixture (the refused CLI commands, a chat server, a verifiers
environment: 15-70 s each) must run on one xdist worker, so the fixture is made once. pytest 9.2 names
a test from ``Node._id``, and pytest-xdist 3.8's ``--dist loadgroup`` renames ``_nodeid``: the groups
were silently ignored and every such fixture was made once per worker (make test 715 s, of which
~150 s were the second copies). This runs a real ``pytest -n 2 --dist loadgroup`` on a scratch module
with this repository's conftest and checks that every test of the module ran in one process.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
import os
import time

import pytest


@pytest.fixture(scope="module")
def shared():
    return os.getpid()


@pytest.mark.parametrize("i", range(6))
def test_uses_the_module_fixture(shared, i, tmp_path_factory):
    time.sleep(0.2)  # long enough for both workers to be handed tests
    out = tmp_path_factory.getbasetemp().parent.parent / "pids"
    with open(out, "a") as f:
        f.write(f"{os.getpid()} {shared}\\n")


@pytest.mark.parametrize("i", range(6))
def test_on_its_own(i):
    time.sleep(0.2)
'''


def test_a_module_with_a_module_fixture_runs_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_scratch.py").write_text(MODULE)
    base = tmp_path / "base" / "inner"
    base.parent.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                           "no:cacheprovider", f"--basetemp={base}", "test_scratch.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in (tmp_path / "base" / "pids").read_text().splitlines()]
    assert len(rows) == 6
    workers = {pid for pid, _ in rows}
    fixtures = {shared for _, shared in rows}
    assert len(workers) == 1 and len(fixtures) == 1, (
        f"the module's tests ran in {len(workers)} workers and its fixture was made {len(fixtures)} times")
