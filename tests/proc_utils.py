"""Process inspection for tests that kill a parent and check its children (Linux /proc)."""

from __future__ import annotations

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
