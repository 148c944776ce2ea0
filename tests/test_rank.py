"""A rank (``python -m hlmtune._rank``) ends cleanly without interpreter teardown, and keeps error exits."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "recipe.py"
    script.write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered pipes, as without -u
    return subprocess.run([sys.executable, "-m", "hlmtune._rank", str(script)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_clean_rank_flushes_output_and_skips_teardown(tmp_path):
    marker = tmp_path / "atexit_ran"
    proc = _run(tmp_path, f"""
import atexit, logging, logging.handlers, sys
atexit.register(lambda: open({str(marker)!r}, "w").close())  # interpreter teardown would run this
# A buffering handler: its records reach the file only when logging shuts down.
target = logging.FileHandler({str(tmp_path / "log.txt")!r})
logging.getLogger("probe").addHandler(logging.handlers.MemoryHandler(1000, flushLevel=logging.CRITICAL, target=target))
logging.getLogger("probe").warning("logged line")
sys.stdout.write("no newline, still delivered")
sys.stderr.write("stderr too")
""")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "no newline, still delivered" and "stderr too" in proc.stderr
    assert "logged line" in (tmp_path / "log.txt").read_text()  # logging flushed before leaving
    assert not marker.exists()  # os._exit: no teardown, so no C++ destructor can deadlock


def test_rank_keeps_exit_codes_of_failures(tmp_path):
    assert _run(tmp_path, "import sys; sys.exit(3)").returncode == 3
    proc = _run(tmp_path, "raise RuntimeError('boom')")
    assert proc.returncode != 0 and "RuntimeError: boom" in proc.stderr
    assert _run(tmp_path, "import sys; sys.exit(0)").returncode == 0


def test_before_fast_exit_callbacks_run_and_one_failure_spares_the_rest(tmp_path):
    first, last = tmp_path / "first", tmp_path / "last"
    proc = _run(tmp_path, f"""
from hlmtune.proc import before_fast_exit
before_fast_exit(lambda: open({str(first)!r}, "w").close())
before_fast_exit(lambda: 1 / 0)
before_fast_exit(lambda: open({str(last)!r}, "w").close())
""")
    assert proc.returncode == 0, proc.stderr
    assert first.exists() and last.exists()  # run although os._exit skips atexit
    assert "ZeroDivisionError" in proc.stderr and "failed before exit" in proc.stderr
