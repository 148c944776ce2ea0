"""Helpers of the sweep tests: grid files, a stand-in for `hlmtune`, shellcheck, tiny data.

The stand-in (``write_stub``) is a small Python program used as the grid's
``environment.hlmtune``: it records the arguments and environment it was started with and
writes the collector's ``metrics/summary.json`` like a finished run, so the sweep machinery
(quoting, skip/resume, status) is tested in milliseconds per task. The real-SLURM tests run
real tiny training instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import pytest
import yaml

HLMTUNE = str(Path(sys.executable).with_name("hlmtune"))

STUB = r'''
import json, os, sys
from pathlib import Path
import yaml
args = sys.argv[1:]
cfg = yaml.safe_load(Path(args[args.index("--config") + 1]).read_text())
out = Path(cfg["output_dir"])
with open(out / "stub_calls.jsonl", "a") as f:
    f.write(json.dumps({"argv": args, "note": os.environ.get("SWEEP_NOTE"), "omp": os.environ.get("OMP_NUM_THREADS")}) + "\n")
fail = os.environ.get("STUB_FAIL")
if fail and fail in out.name:
    sys.exit(3)
(out / "metrics").mkdir(parents=True, exist_ok=True)
(out / "metrics" / "summary.json").write_text(json.dumps({"complete": True, "steps": 1}))
'''


def write_stub(tmp: Path) -> str:
    """Write the stand-in program; returns the ``environment.hlmtune`` command for it."""
    p = tmp / "stub_hlmtune.py"
    p.write_text(STUB)
    return f"{sys.executable} {p}"


def write_alpaca(path: Path, rows: int = 64) -> Path:
    """A small instruction set in the alpaca-cleaned layout (deterministic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"instruction": f"Add {i} and {i + 1}.", "input": "", "output": f"The sum is {2 * i + 1}."})
             for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_grid(path: Path, grid: Dict[str, Any]) -> Path:
    """Write a grid mapping as YAML."""
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


def tiny_grid(name: str, model_dir: Path, data_file: Path, **extra: Any) -> Dict[str, Any]:
    """A CPU grid of the tiny LoRA config: 1 rank, a few steps."""
    grid: Dict[str, Any] = {
        "name": name,
        "config": "tiny_lora",
        "set": {"model_dir": str(model_dir), "data_dir": str(data_file.parent), "max_steps_per_epoch": 3, "batch_size": 2},
        "node": {"gpus": 0, "cpus": 2},
        "slurm": {"time": "00:10:00"},
        "axes": {"lr": {"key": "optimizer.lr", "values": [0.001, 0.002]}},
    }
    grid.update(extra)
    return grid


def sweep_cli(*args: str, cwd: Optional[Path] = None, env: Optional[Dict[str, str]] = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``hlmtune sweep ARGS`` as a subprocess (the real console script)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([HLMTUNE, "sweep", *args], capture_output=True, text=True, cwd=cwd, env=full_env, timeout=timeout)


def shellcheck_bin() -> str:
    """Path of ``shellcheck``; installed from Debian's packages when missing (root + apt), else skip."""
    found = shutil.which("shellcheck")
    if found:
        return found
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"],
                       capture_output=True, env=env, timeout=600)
        found = shutil.which("shellcheck")
        if found:
            return found
    pytest.skip("shellcheck is not installed and could not be installed (needs root and apt-get: apt-get install shellcheck)")


def assert_shellcheck_clean(path: Path) -> None:
    """shellcheck (bash, every severity) reports nothing for the script."""
    proc = subprocess.run([shellcheck_bin(), "--shell=bash", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, f"shellcheck {path}:\n{proc.stdout}{proc.stderr}"
