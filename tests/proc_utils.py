"""Process inspection for tests that kill a parent and check its children (Linux /proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List


def _stat_fields(pid: int | str) -> List[str]:
    """Fields of /proc/<pid>/stat after ``pid (comm)``: state, ppid, ... (empty if gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()


def children(pid: int) -> List[int]:
    """Live child processes of ``pid`` (zombies count as gone)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            fields = _stat_fields(d.name)
            if fields and int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie is not running)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def child_outlives_a_killed_parent(tmp_path: Path, call: str, timeout_s: float = 10.0) -> bool:
    """Kill -9 a Python process while ``call`` runs a sleeping child in it; True if the child lives on.

    ``call`` is Python source run in the parent with ``CMD`` (the child's argv) and ``LOG`` (a path
    under ``tmp_path``) defined, e.g. ``"from hlmtune.hlm import select; select.run_process(CMD, {}, LOG)"``.
    The child is killed here in any case, so a failing test leaves nothing behind.
    """
    pid_file = tmp_path / "child.pid"
    child = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"]
    code = f"import os, sys; from pathlib import Path; CMD = {child!r}; LOG = Path({str(tmp_path / 'child.log')!r}); {call}"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()) and parent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not (pid_file.exists() and pid_file.read_text()):
        parent.kill()
        raise AssertionError(f"the child never started: {parent.communicate()[1][-2000:]!r}")
    pid = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    lived = alive(pid)
    if lived:
        os.kill(pid, signal.SIGKILL)
    return lived
