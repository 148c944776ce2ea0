"""A RunError in a recipe process: one line, exit status 2; other errors keep their traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(body: str) -> subprocess.CompletedProcess:
    code = "from hlmtune.training.errors import RunError, install_exit_hook\ninstall_exit_hook()\ninstall_exit_hook()\n" + body
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_run_error_is_one_line_exit_2():
    proc = _run("raise RunError('output_dir /x is in use by a live run')")
    assert proc.returncode == 2
    assert proc.stderr == "error: output_dir /x is in use by a live run\n"


def test_rank_is_named_when_there_are_several(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    proc = _run("raise RunError('bad')")
    assert (proc.returncode, proc.stderr) == (2, "[rank 1] error: bad\n")


@pytest.mark.parametrize("body", ["raise ValueError('a bug')", "import sys; sys.exit(3)"])
def test_other_exceptions_keep_their_traceback_and_status(body):
    proc = _run(body)
    if "ValueError" in body:
        assert proc.returncode == 1 and "Traceback" in proc.stderr and "ValueError: a bug" in proc.stderr
    else:
        assert proc.returncode == 3
