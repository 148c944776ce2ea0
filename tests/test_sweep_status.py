"""``hlmtune sweep status`` / ``--resume`` against stand-ins of SLURM's client commands (scripts
named squeue / sacct / sbatch first on PATH): what a task's state is when the queue, the
accounting and the task's own events disagree or are missing, and what a half-refused
submission leaves recorded. The real cluster is exercised in test_sweep_slurm.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

import pytest

from hlmtune.sweep.grid import expand, load_grid
from hlmtune.sweep.prepare import SUBMISSIONS, SweepError, build_plan, write_plan
from hlmtune.sweep.render import render_plan
from hlmtune.sweep.slurm import submit
from hlmtune.sweep.status import incomplete, task_states
from sweep_helpers import write_grid, write_stub


def _sweep(tmp: Path, axes: Dict) -> tuple:
    grid = {"name": "st", "config": "tiny_lora", "set": {"model_dir": "/m", "data_dir": "/d"},
            "node": {"gpus": 0, "cpus": 4}, "environment": {"hlmtune": write_stub(tmp)}, "axes": axes}
    g = load_grid(write_grid(tmp / "st.yaml", grid))
    plan = build_plan(g, expand(g), tmp / "runs" / "st", progress=False)
    render_plan(plan, None)
    write_plan(plan, resume=False)
    return plan.manifest, tmp / "runs" / "st"


def _clients(tmp: Path, monkeypatch, **scripts: str) -> None:
    """Shell scripts standing in for SLURM's commands, first on PATH."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        f = bin_dir / name
        f.write_text("#!/bin/bash\n" + body + "\n")
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _submitted(d: Path, job: str, tasks) -> None:
    (d / SUBMISSIONS).write_text(json.dumps([{"arrays": [{"group": 0, "job_id": job, "array": "0-1", "tasks": tasks}]}]))


LR = {"lr": {"key": "optimizer.lr", "values": [0.001, 0.002]}}


def test_a_failing_queue_query_is_an_error_not_an_empty_queue(tmp_path, monkeypatch):
    """squeue timing out says nothing about what runs: --resume must not resubmit a running task
    into its live run folder. A job the controller no longer knows is no job queued."""
    manifest, d = _sweep(tmp_path, LR)
    _submitted(d, "900", [0, 1])
    run0 = d / manifest["tasks"][0]["dir"]
    run0.mkdir(exist_ok=True)
    (run0 / "task_events.jsonl").write_text(json.dumps({"event": "start", "task": 0}) + "\n")
    _clients(tmp_path, monkeypatch, squeue='echo "slurm_load_jobs error: Socket timed out" >&2; exit 1',
             sacct='echo "900_0|RUNNING"; echo "900_1|PENDING"')
    with pytest.raises(SweepError, match="squeue failed .*Socket timed out.*cannot tell which tasks"):
        incomplete(manifest, d)
    # the queue answers nothing, accounting still has them running and pending: not resubmitted
    _clients(tmp_path, monkeypatch, squeue="exit 0")
    assert [(r["state"], r["detail"]) for r in task_states(manifest, d)] == [("running", "running"), ("pending", "pending")]
    assert incomplete(manifest, d) == []
    _clients(tmp_path, monkeypatch, squeue='echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
             sacct='echo "900_0|COMPLETED"')
    assert [r["state"] for r in task_states(manifest, d)] == ["interrupted", "not run"]


def test_a_task_that_failed_before_it_started_is_failed(tmp_path, monkeypatch):
    """No event of its own (the environment hook failed, out of memory at start), but accounting
    says FAILED: failed, not "not run"."""
    manifest, d = _sweep(tmp_path, LR)
    _submitted(d, "500", [0, 1])
    _clients(tmp_path, monkeypatch, squeue="exit 0", sacct='echo "500_0|FAILED"')
    rows = task_states(manifest, d)
    assert (rows[0]["state"], rows[0]["detail"]) == ("failed", "failed, before it started")
    assert rows[1]["state"] == "not run" and incomplete(manifest, d) == [0, 1]


def test_arrays_queued_before_a_refused_sbatch_are_recorded(tmp_path, monkeypatch):
    """The first group's array is queued, the second's sbatch refused: the first is in
    submissions.json, so status sees it and --resume does not submit it again."""
    manifest, d = _sweep(tmp_path, {"devices": [1, 2]})
    assert len(manifest["groups"]) == 2
    count = tmp_path / "calls"
    _clients(tmp_path, monkeypatch, scontrol="exit 1", squeue='echo "700|0|RUNNING"',
             sbatch=f'n=$(($(cat {count} 2>/dev/null || echo 0) + 1)); echo $n > {count}\n'
                    'if [ "$n" = 1 ]; then echo 700; else echo "sbatch: error: Invalid account" >&2; exit 1; fi')
    with pytest.raises(SweepError, match="Invalid account"):
        submit(manifest, d, [0, 1], None)
    (entry,) = json.loads((d / SUBMISSIONS).read_text())
    assert [(a["job_id"], a["tasks"]) for a in entry["arrays"]] == [("700", [0])] and entry["collect_job_id"] is None
    assert incomplete(manifest, d) == [1]
