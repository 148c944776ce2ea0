"""The SLURM side: submit the arrays and the collect job, read task states back.

Only the standard client commands are used (``sbatch --parsable``, ``squeue``, ``sacct``,
``scontrol``), so this works on any cluster and on the single-node test cluster alike.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hlmtune.sweep.prepare import SweepError, record_submission
from hlmtune.sweep.render import array_spec

_TIMEOUT = 60


def _run(cmd: List[str]) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise SweepError(f"{cmd[0]} is not on PATH: submit from a SLURM login node, or run the tasks here with --local")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT)


def sbatch(args: List[str]) -> str:
    """``sbatch --parsable ARGS``; returns the job id.

    Raises:
        SweepError: sbatch refused (its message included).
    """
    proc = _run(["sbatch", "--parsable", *args])
    if proc.returncode != 0:
        raise SweepError(f"sbatch {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def max_array_size() -> Optional[int]:
    """The cluster's ``MaxArraySize`` (array indices must be below it), or None if unknown."""
    try:
        proc = _run(["scontrol", "show", "config"])
    except (SweepError, OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^MaxArraySize\s*=\s*(\d+)", proc.stdout, re.MULTILINE)
    return int(m.group(1)) if m else None


def submit(manifest: Dict[str, Any], sweep_dir: Path, task_ids: Sequence[int], max_concurrent: Optional[int],
           *, collect: bool = True) -> Dict[str, Any]:
    """Submit the given tasks (one array per resource group) and the dependent collect job.

    Args:
        manifest (Dict[str, Any]): the sweep manifest.
        sweep_dir (Path): the sweep directory (scripts inside).
        task_ids (Sequence[int]): tasks to run (``--resume``: the incomplete ones).
        max_concurrent (Optional[int]): ``%K`` per array.
        collect (bool): also submit ``collect.sbatch`` with ``afterany`` on the arrays.

    Returns:
        Dict[str, Any]: the submission record (also appended to ``submissions.json``).

    Raises:
        SweepError: an index the cluster cannot take, or sbatch refusing a script.
    """
    wanted = set(task_ids)
    limit = max_array_size()
    if limit is not None and wanted and max(wanted) >= limit:
        raise SweepError(f"task id {max(wanted)} is not below this cluster's MaxArraySize={limit}: "
                         "split the grid into sweeps of fewer tasks")
    arrays: List[Dict[str, Any]] = []
    entry: Dict[str, Any] = {"time": datetime.now(timezone.utc).isoformat(), "arrays": arrays, "collect_job_id": None}
    try:
        for g in manifest["groups"]:
            ids = [i for i in g["tasks"] if i in wanted]
            if not ids:
                continue
            spec = array_spec(ids, max_concurrent)
            job = sbatch([f"--array={spec}", str(sweep_dir / g["script"])])
            arrays.append({"group": g["id"], "job_id": job, "array": spec, "tasks": ids})
        if collect and arrays and (sweep_dir / "collect.sbatch").exists():
            dep = "afterany:" + ":".join(a["job_id"] for a in arrays)
            entry["collect_job_id"] = sbatch([f"--dependency={dep}", "--kill-on-invalid-dep=yes",
                                              str(sweep_dir / "collect.sbatch")])
    finally:
        # Arrays already queued are recorded even when a later sbatch is refused: status sees
        # them and --resume does not submit their tasks a second time.
        if arrays:
            record_submission(sweep_dir, entry)
    return entry


def queue_states(job_ids: Sequence[str]) -> Dict[tuple, str]:
    """Pending/running array tasks from ``squeue``: ``(array job id, task id) -> state``.

    Returns an empty mapping when squeue is unavailable.
    """
    if not job_ids or shutil.which("squeue") is None:
        return {}
    proc = subprocess.run(["squeue", "-h", "-r", "-j", ",".join(job_ids), "-o", "%F|%K|%T"],
                          capture_output=True, text=True, timeout=_TIMEOUT)
    if proc.returncode != 0 and "invalid job id" not in proc.stderr.lower():
        # (An invalid job id is a job the controller no longer knows: finished long ago, none queued.)
        # Anything else (a controller timeout) says nothing about what runs: an empty answer would
        # have --resume submit running tasks again into their live run folders.
        raise SweepError(f"squeue failed (exit {proc.returncode}: {proc.stderr.strip()[:300]}): cannot tell which "
                         "tasks are queued or running; try again when the controller answers")
    out: Dict[tuple, str] = {}
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[1].isdigit():
            out[(parts[0], int(parts[1]))] = parts[2]
    return out


def accounting_states(job_ids: Sequence[str]) -> Dict[tuple, str]:
    """Final states of array tasks (``sacct``; ``scontrol show job`` when accounting is off).

    Returns:
        Dict[tuple, str]: ``(array job id, task id) -> state`` (e.g. COMPLETED, FAILED, TIMEOUT).
    """
    out: Dict[tuple, str] = {}
    if not job_ids:
        return out
    if shutil.which("sacct"):
        proc = subprocess.run(["sacct", "-n", "-P", "-X", "-j", ",".join(job_ids), "--format=JobID,State"],
                              capture_output=True, text=True, timeout=_TIMEOUT)
        if proc.returncode == 0:
            for line in proc.stdout.splitlines():
                m = re.match(r"^(\d+)_(\d+)\|(\S+)", line.strip())
                if m:
                    out[(m.group(1), int(m.group(2)))] = m.group(3)
            if out:
                return out
    if shutil.which("scontrol"):
        for job in job_ids:
            proc = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=_TIMEOUT)
            for line in proc.stdout.splitlines():
                fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
                if fields.get("ArrayJobId") == job and fields.get("ArrayTaskId", "").isdigit():
                    out[(job, int(fields["ArrayTaskId"]))] = fields.get("JobState", "?")
    return out
