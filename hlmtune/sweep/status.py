"""``hlmtune sweep status``: done / running / pending / failed per task.

Sources, in order: the run directory (``metrics/summary.json`` = done; the task's own
``task_events.jsonl`` = started / ended with an exit code), then SLURM for the array jobs the
sweep submitted (``squeue`` for pending and running tasks, ``sacct`` or ``scontrol`` for how a
task ended). Without SLURM (``--local`` sweeps) the run directories alone decide.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from hlmtune.sweep.prepare import EVENTS, METRICS_DIR, load_submissions, run_complete

# SLURM states of a task that ended badly (sacct / scontrol names).
_FAILED = ("FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE")
# States of a task waiting to run, as squeue and sacct name them; and of one running (sacct: a
# task squeue does not list may still be queued or running there).
_PENDING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")
_ACCOUNTED_RUNNING = ("RUNNING", "COMPLETING", "CONFIGURING", "RESIZING", "SIGNALING", "STAGE_OUT")
# Headline metrics for the per-task table (from the collector's summary).
METRIC_KEYS = ("steps", "loss_last", "iteration_time_s_median", "tokens_per_second", "peak_memory_alloc_gib",
               "peak_rss_gib", "total_time_s", "wall_time_s")


def read_events(run_dir: Path) -> List[Dict[str, Any]]:
    """The task's events (start / end / requeue / skipped); unparsable lines are skipped."""
    p = Path(run_dir) / EVENTS
    out = []
    if p.exists():
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill: the next event still counts
    return out


def _latest_jobs(sweep_dir: Path) -> Dict[int, str]:
    """Task id -> the array job id of its most recent submission."""
    jobs: Dict[int, str] = {}
    for sub in load_submissions(sweep_dir):
        for arr in sub.get("arrays", []):
            for t in arr["tasks"]:
                jobs[int(t)] = str(arr["job_id"])
    return jobs


def task_states(manifest: Dict[str, Any], sweep_dir: Path, *, use_slurm: bool = True) -> List[Dict[str, Any]]:
    """One row per task: ``id, name, state, detail, job, steps, run_dir``.

    States: ``done``, ``running``, ``pending``, ``failed``, ``interrupted`` (started, no end
    and no queue entry), ``not run``.

    Args:
        manifest (Dict[str, Any]): the sweep manifest.
        sweep_dir (Path): the sweep directory.
        use_slurm (bool): ask squeue / sacct about submitted tasks.

    Returns:
        List[Dict[str, Any]]: rows in task order.
    """
    from hlmtune.sweep import slurm

    jobs = _latest_jobs(sweep_dir)
    queued: Dict[tuple, str] = {}
    final: Dict[tuple, str] = {}
    if use_slurm and jobs:
        ids = sorted(set(jobs.values()))
        queued = slurm.queue_states(ids)
    rows = []
    need_acct = []
    for t in manifest["tasks"]:
        run_dir = Path(t["run_dir"])
        job = jobs.get(t["id"])
        events = read_events(run_dir)
        steps_file = run_dir / METRICS_DIR / "steps.jsonl"
        steps = sum(1 for line in steps_file.read_text(encoding="utf-8").splitlines() if line.strip()) if steps_file.exists() else 0
        row = {"id": t["id"], "name": t["name"], "state": "not run", "detail": "", "job": f"{job}_{t['id']}" if job else "",
               "steps": steps, "run_dir": str(run_dir), "axes": t["axes"]}
        q = queued.get((job, t["id"])) if job else None
        last = events[-1] if events else None
        if run_complete(run_dir):
            row["state"] = "done"
        elif q in _PENDING:
            row["state"], row["detail"] = "pending", q.lower()
        elif q is not None:
            row["state"], row["detail"] = "running", q.lower()
        elif last is not None and last.get("event") == "end":
            code = last.get("exit_code")
            row["state"], row["detail"] = ("failed", f"exit {code}") if code != 0 else ("failed", "exit 0 without a run summary")
        elif last is not None:
            row["state"], row["detail"] = "interrupted", f"last event: {last.get('event')}"
            if job:
                need_acct.append(row)
        elif job:  # submitted, not queued, no event: it may have failed before it could start
            need_acct.append(row)
        rows.append(row)
    if use_slurm and need_acct:
        final = slurm.accounting_states(sorted({r["job"].split("_")[0] for r in need_acct}))
        for r in need_acct:
            jid, _, tid = r["job"].partition("_")
            st = final.get((jid, int(tid))) if tid else None
            state = st.split()[0] if st else None
            if state in _FAILED:
                r["state"], r["detail"] = "failed", st.lower() + ("" if r["state"] == "interrupted" else ", before it started")
            elif state in _PENDING:  # accounting still has it queued or running
                r["state"], r["detail"] = "pending", state.lower()
            elif state in _ACCOUNTED_RUNNING:
                r["state"], r["detail"] = "running", state.lower()
    return rows


def summary_line(rows: List[Dict[str, Any]]) -> str:
    """``4 tasks: 3 done, 1 failed``."""
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    order = ("done", "running", "pending", "failed", "interrupted", "not run")
    return f"{len(rows)} tasks: " + ", ".join(f"{counts[s]} {s}" for s in order if s in counts)


def format_rows(rows: List[Dict[str, Any]]) -> str:
    """A plain-text table for the terminal."""
    head = ("task", "state", "detail", "steps", "job", "name")
    table = [head] + [(str(r["id"]), r["state"], r["detail"], str(r["steps"]), r["job"], r["name"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in table]
    return "\n".join(lines)


def task_table(manifest: Dict[str, Any], rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per-task table rows: axis values, state and the collector's headline metrics.

    ``hlmtune collect`` groups runs by method/dataset/devices...; axes it does not know (an
    ECG context window, a learning rate) stay apart here, one row per task.
    """
    from hlmtune.profiling.runs import RunReadError, load_run

    axes = list(manifest["tasks"][0]["axes"]) if manifest["tasks"] else []
    out = []
    for r in rows:
        rec: Dict[str, Any] = {"task": r["id"], **{a: r["axes"].get(a) for a in axes}, "state": r["state"]}
        summary: Dict[str, Any] = {}
        metrics = Path(r["run_dir"]) / METRICS_DIR
        if (metrics / "steps.jsonl").exists():
            try:
                summary = load_run(metrics)["summary"]
            except RunReadError:
                summary = {}
        for k in METRIC_KEYS:
            rec[k] = summary.get(k)
        rec["run_dir"] = r["run_dir"]
        out.append(rec)
    return out


def write_table(table: List[Dict[str, Any]], out_dir: Path) -> List[Path]:
    """``tasks.csv`` and ``tasks.md`` (atomic writes)."""
    from hlmtune.files import atomic_write_text

    if not table:
        return []
    cols = list(table[0])
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(table)

    def fmt(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v).replace("|", "\\|")

    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(fmt(row[c]) for c in cols) + " |" for row in table]
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / "tasks.csv", buf.getvalue())
    atomic_write_text(out_dir / "tasks.md", "\n".join(md) + "\n")
    return [out_dir / "tasks.csv", out_dir / "tasks.md"]


def incomplete(manifest: Dict[str, Any], sweep_dir: Path, *, use_slurm: bool = True) -> List[int]:
    """Tasks to run again: not done, and not pending or running in SLURM."""
    return [r["id"] for r in task_states(manifest, sweep_dir, use_slurm=use_slurm) if r["state"] not in ("done", "pending", "running")]


def first_failure(rows: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The first failed task, if any (for a hint where to look)."""
    return next((r for r in rows if r["state"] == "failed"), None)
