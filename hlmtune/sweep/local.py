"""``hlmtune sweep --local``: the manifest's tasks one after another on this machine, no SLURM.

Each task behaves as its array task would: a complete run is skipped, checkpoints of an
earlier attempt are resumed, the environment hook and variables apply, start/end events go
to ``task_events.jsonl``, and the output goes to ``<run>/local.log``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from hlmtune.sweep.prepare import EVENTS, SweepError, run_complete


def _event(run_dir: Path, task_id: int, event: str, **extra: Any) -> None:
    rec = {"event": event, "time": time.time(), "job_id": "", "array_job_id": "", "task": task_id,
           "host": socket.gethostname(), "restart": 0, **extra}
    with open(run_dir / EVENTS, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def has_checkpoint(run_dir: Path) -> bool:
    """A complete resumable checkpoint (``checkpoints/step_N/state.json``, not ``.partial``)."""
    root = Path(run_dir) / "checkpoints"
    return root.is_dir() and any(
        d.name.startswith("step_") and not d.name.endswith(".partial") and (d / "state.json").exists() for d in root.iterdir()
    )


def task_command(manifest: Dict[str, Any], task: Dict[str, Any]) -> List[str]:
    """The task's argv on this machine (container prefix, resume flag when a checkpoint exists)."""
    argv = list(task["argv"])
    if has_checkpoint(Path(task["run_dir"])):
        argv.append("resume_from_checkpoint=True")
    c = manifest.get("container")
    if c:
        runtime = c["runtime"] if c["runtime"] != "auto" else ("apptainer" if _which("apptainer") else "singularity")
        opts = (["--nv"] if manifest["node"].get("gpus") else []) + [x for b in c["binds"] for x in ("--bind", b)] + c["options"]
        argv = [runtime, "exec", *opts, c["image"], *argv]
    return argv


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


def run_local(manifest: Dict[str, Any], grid_env: Dict[str, Any], task_ids: Sequence[int]) -> int:
    """Run tasks sequentially.

    Args:
        manifest (Dict[str, Any]): the sweep manifest.
        grid_env (Dict[str, Any]): the grid's ``environment`` (``setup`` shell lines, ``vars``).
        task_ids (Sequence[int]): tasks to run.

    Returns:
        int: 0 when every task ended complete, 1 otherwise.

    Raises:
        SweepError: a multi-node task (needs SLURM).
    """
    from tqdm import tqdm

    tasks = [manifest["tasks"][i] for i in task_ids]
    for t in tasks:
        if t["slurm"]["nodes"] > 1:
            raise SweepError(f"task {t['id']} ({t['name']}) needs {t['slurm']['nodes']} nodes: --local runs single-node tasks only")
    failed = []
    for t in tqdm(tasks, desc=f"sweep {manifest['name']} (local)", unit="task", file=sys.stderr):
        run_dir = Path(t["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        if run_complete(run_dir):
            _event(run_dir, t["id"], "skipped")
            continue
        argv = task_command(manifest, t)
        env = dict(os.environ)
        env.update(grid_env.get("vars") or {})
        env.setdefault("OMP_NUM_THREADS", str(max(1, t["slurm"]["cpus_per_task"] // t["slurm"]["devices"])))
        if grid_env.get("setup"):
            # The hook is shell code; the task's argv is passed as "$@", never pasted into it.
            argv = ["bash", "-c", grid_env["setup"] + '\nexec "$@"', "hlmtune-sweep-task", *argv]
        _event(run_dir, t["id"], "start")
        with open(run_dir / "local.log", "a", encoding="utf-8") as log:
            log.write(f"# task {t['id']}: {' '.join(argv)}\n")
            log.flush()
            rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=manifest["workdir"])
        _event(run_dir, t["id"], "end", exit_code=rc)
        if rc != 0 or not run_complete(run_dir):
            failed.append(t)
            print(f"task {t['id']} ({t['name']}) failed (exit {rc}): see {run_dir / 'local.log'}", file=sys.stderr)
    done = len(tasks) - len(failed)
    print(f"{done}/{len(tasks)} task(s) complete" + (f"; failed: {', '.join(str(t['id']) for t in failed)}"
                                                       " (rerun them with --resume --local)" if failed else ""))
    return 1 if failed else 0
