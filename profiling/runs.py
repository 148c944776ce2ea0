"""Run directories written by the collector: file names, atomic writes, reading, summaries.

A run directory (the collector's ``log_dir``) holds:

- ``run.json``: run metadata (written atomically at start, rewritten at close);
- ``steps.jsonl``: one JSON object per logged optimizer step, flushed line by line;
- ``summary.json``: written atomically by ``close()`` only, so its presence means the run
  finished. A killed run has no summary: :func:`load_run` rebuilds one from ``steps.jsonl``
  (tolerating a truncated last line) and marks it ``complete: false``. An unreadable line
  costs that step only (skipped, named by file and line); a finished run whose log lost lines
  keeps its ``summary.json``.

This module imports nothing heavy (no torch): ``hlmtune collect`` reads runs with it.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from hlmtune.files import atomic_write_text

RUN_FILE = "run.json"
STEPS_FILE = "steps.jsonl"
SUMMARY_FILE = "summary.json"
API_SUMMARY_FILE = "api_summary.json"
SUPERSEDED_PREFIX = "superseded-"
RUN_SCHEMA = "hlmtune.run/1"
SUMMARY_SCHEMA = "hlmtune.summary/1"

# Step keys whose maximum over the run is reported in the summary (GiB).
_PEAK_KEY = re.compile(r"^peak_(memory_(alloc|reserved|active)|rss)_gib(_rank\d+)?$")


class RunReadError(ValueError):
    """A run directory that cannot be read; the message names the file and line."""


def profiled_command(cmd: List[str], tool: str) -> Optional[List[str]]:
    """The command to profile from ``hlmtune profile <tool> -- <cmd...>`` (None, with an error printed, if empty)."""
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print(f"hlmtune profile {tool}: error: give the command to profile after `--`, e.g. hlmtune profile {tool} -- hlmtune run ...", file=sys.stderr)
        return None
    return cmd


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON (non-finite floats become null)."""
    atomic_write_text(path, json.dumps(sanitize(obj), indent=2, sort_keys=False) + "\n")


def sanitize(obj: Any) -> Any:
    """Make ``obj`` strict-JSON: NaN/inf -> None, tuples -> lists, unknown objects -> str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return str(obj)


def _whole(v: Any) -> bool:
    """A step count as JSON writes one: an integer (not a bool, not a string)."""
    return isinstance(v, int) and not isinstance(v, bool)


def read_steps(path: str | os.PathLike) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Read ``steps.jsonl``, skipping lines that cannot be read.

    A last line without its newline that does not parse is the mark of a run killed while
    writing ("truncated last line dropped"). Any other unreadable line (not JSON, or not an
    object with a ``step``) costs that record only: it is skipped and named by file and
    line ("corrupt line skipped"), and the rest of the run is kept.

    Args:
        path (str | os.PathLike): the steps file.

    Returns:
        Tuple[List[Dict[str, Any]], List[str]]: the step records and one note per line lost.
    """
    path = Path(path)
    raw = path.read_bytes()
    notes: List[str] = []
    lines = raw.split(b"\n")
    # ``lines[-1]`` is b"" when the file ends with a newline (the normal case).
    records: List[Dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        is_last = i == len(lines) - 1  # no newline after it: possibly cut mid-write
        try:
            obj = json.loads(line.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            if is_last:
                notes.append(f"{path}:{i + 1}: truncated last line dropped ({len(line)} bytes)")
            else:
                notes.append(f"{path}:{i + 1}: corrupt line skipped (not JSON: {e})")
            continue
        if not isinstance(obj, dict) or "step" not in obj:
            notes.append(f"{path}:{i + 1}: corrupt line skipped (expected an object with a 'step' key)")
            continue
        if not all(_whole(obj[k]) for k in ("step", "steps_elapsed") if k in obj):
            notes.append(f"{path}:{i + 1}: corrupt line skipped ('step' and 'steps_elapsed' must be whole numbers)")
            continue
        records.append(obj)
    return records, notes


def percentile(values: List[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default ``linear`` method).

    Args:
        values (List[float]): samples.
        q (float): percentile in [0, 100].

    Returns:
        Optional[float]: the percentile, None for no samples.
    """
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(xs: List[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def summarize_steps(records: List[Dict[str, Any]], *, warmup_steps: int, world_size: int = 1) -> Dict[str, Any]:
    """Summarize step records (the definitions behind ``summary.json``).

    Definitions (all times in seconds, memory in GiB):

    - a record covers ``steps_elapsed`` optimizer steps (1 unless the recipe logs every n
      steps); its ``iteration_time_s`` is the mean wall time of those steps;
    - warmup: records within the first ``warmup_steps`` optimizer steps of the run are
      excluded from the iteration-time statistics and the throughput;
    - a record with ``steps_elapsed`` 0 (a second call for an already logged step) carries
      values (memory peaks) but no timing;
    - ``iteration_time_s_mean/median/p90``: over post-warmup records;
    - ``total_time_s``: training-loop time = sum over all records of
      ``iteration_time_s * steps_elapsed``; a record without a time (the first call of a
      torchtune built-in recipe has no previous call to time against) counts as its steps
      times the post-warmup mean, and ``total_time_extrapolated_steps`` says how many steps
      were filled in that way;
    - ``tokens_per_second``: post-warmup tokens / post-warmup time when the recipe logs
      ``tokens``, else the mean of the logged ``tokens_per_second``;
    - ``peak_*_gib``: maximum over all records (including warmup).

    Args:
        records (List[Dict[str, Any]]): step records in file order.
        warmup_steps (int): optimizer steps excluded from timing statistics.
        world_size (int): devices (for ``tokens_per_second_per_gpu``).

    Returns:
        Dict[str, Any]: the summary (without ``complete``; the caller sets it).
    """
    acc = _StepTotals()
    # Warmup counts from the first step of this run (a resumed run starts at a later step).
    base = int(records[0]["step"]) - int(records[0].get("steps_elapsed", 1)) if records else 0
    for r in records:
        acc.add(r, post=int(r["step"]) > base + warmup_steps)
    post_times = [t for t, _ in acc.timed]
    total, extrapolated = acc.total_time()
    tps = acc.tokens_post / acc.time_post if acc.tokens_known and acc.time_post > 0 else _mean(acc.tps_values)
    summary: Dict[str, Any] = {
        "schema": SUMMARY_SCHEMA,
        "records": len(records),
        "steps": sum(int(r.get("steps_elapsed", 1)) for r in records),
        "first_step": int(records[0]["step"]) if records else None,
        "last_step": int(records[-1]["step"]) if records else None,
        "warmup_steps": warmup_steps,
        "timed_records": len(post_times),
        "iteration_time_s_mean": _mean(post_times),
        "iteration_time_s_median": percentile(post_times, 50),
        "iteration_time_s_p90": percentile(post_times, 90),
        "iteration_time_s_min": min(post_times) if post_times else None,
        "iteration_time_s_max": max(post_times) if post_times else None,
        "total_time_s": total,
        "total_time_extrapolated_steps": extrapolated,
        "tokens_total": acc.tokens_total if (acc.tokens_known and records) else None,
        "tokens_per_second": tps,
        "tokens_per_second_per_gpu": tps / world_size if tps is not None and world_size else None,
        "data_time_s_mean": _mean(acc.data_times),
        "loss_first": acc.losses[0] if acc.losses else None,
        "loss_last": acc.losses[-1] if acc.losses else None,
    }
    for k in sorted(acc.peaks):
        summary[k] = acc.peaks[k]
    return summary


@dataclass
class _StepTotals:
    """What :func:`summarize_steps` accumulates over the records (definitions there)."""

    timed: List[Tuple[float, int]] = field(default_factory=list)  # (iteration_time_s, steps_elapsed), post-warmup
    all_timed: List[Tuple[float, int]] = field(default_factory=list)
    untimed_steps: int = 0
    tokens_post: float = 0.0
    time_post: float = 0.0
    tokens_known: bool = True
    tps_values: List[float] = field(default_factory=list)
    tokens_total: float = 0.0
    peaks: Dict[str, float] = field(default_factory=dict)
    losses: List[float] = field(default_factory=list)
    data_times: List[float] = field(default_factory=list)

    def add(self, r: Dict[str, Any], *, post: bool) -> None:
        """One step record; ``post``: after the warmup steps."""
        for k, v in r.items():
            if _PEAK_KEY.match(k):
                fv = _num(v)
                if fv is not None and fv > self.peaks.get(k, -1.0):
                    self.peaks[k] = fv
        n = int(r.get("steps_elapsed", 1))
        if n == 0:  # an extra record for an already logged step: values only, no timing
            return
        t = _num(r.get("iteration_time_s"))
        if t is None:
            self.untimed_steps += n
        else:
            self.all_timed.append((t, n))
            if post:
                self.timed.append((t, n))
        tok = _num(r.get("tokens"))
        if tok is None:
            self.tokens_known = False
        else:
            self.tokens_total += tok * n
        if post:
            if t is not None and tok is not None:
                self.tokens_post += tok * n
                self.time_post += t * n
            tps = _num(r.get("tokens_per_second"))
            if tps is not None:
                self.tps_values.append(tps)
            dt = _num(r.get("data_time_s"))
            if dt is not None:
                self.data_times.append(dt)
        loss = _num(r.get("loss"))
        if loss is not None:
            self.losses.append(loss)

    def total_time(self) -> Tuple[Optional[float], int]:
        """(training-loop time, steps whose time was filled in with the post-warmup mean)."""
        post_times = [t for t, _ in self.timed]
        fill = _mean(post_times) if post_times else _mean([t for t, _ in self.all_timed])
        total = sum(t * n for t, n in self.all_timed)
        extrapolated = 0
        if self.untimed_steps and fill is not None:
            total += self.untimed_steps * fill
            extrapolated = self.untimed_steps
        return (total if (self.all_timed or extrapolated) else None), extrapolated


def is_superseded(path: Path) -> bool:
    """True when ``path`` lies in a ``superseded-*`` folder (an earlier run moved aside)."""
    return any(part.startswith(SUPERSEDED_PREFIX) for part in path.parts)


def find_run_dirs(paths: Iterable[str | os.PathLike]) -> Tuple[List[Path], List[Dict[str, str]]]:
    """Find run directories (folders with ``run.json`` or ``steps.jsonl``) under ``paths``.

    Args:
        paths (Iterable[str | os.PathLike]): run directories or parents holding many.

    Returns:
        Tuple[List[Path], List[Dict[str, str]]]: sorted run directories, and problems
        (``path``, ``reason``) for arguments that hold no run and for superseded runs.
    """
    found: List[Path] = []
    problems: List[Dict[str, str]] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            problems.append({"path": str(p), "reason": "missing: path does not exist"})
            continue
        candidates = set()
        if p.is_file():
            p = p.parent
        for name in (RUN_FILE, STEPS_FILE):
            for f in p.rglob(name):
                candidates.add(f.parent)
        if not candidates:
            problems.append({"path": str(p), "reason": f"missing: no {RUN_FILE} or {STEPS_FILE} under it"})
            continue
        for c in sorted(candidates):
            if is_superseded(c.relative_to(p)) if c != p else False:
                problems.append({"path": str(c), "reason": "superseded: an earlier run moved aside by a rerun in the same log_dir"})
                continue
            if c not in found:
                found.append(c)
    return sorted(found), problems


def _read_json(path: Path, *, mapping: bool = True) -> Any:
    """The JSON document in ``path``, or None when the file does not exist.

    Args:
        path (Path): the file.
        mapping (bool): the document must be a JSON object.

    Raises:
        RunReadError: invalid JSON, or not an object where ``mapping``; the message names the file.
    """
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise RunReadError(f"{path}: not valid JSON ({e})") from None
    if mapping and not isinstance(doc, dict):
        raise RunReadError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def load_run(run_dir: str | os.PathLike, *, warmup_steps: Optional[int] = None) -> Dict[str, Any]:
    """Read one run directory.

    Args:
        run_dir (str | os.PathLike): the collector's ``log_dir``.
        warmup_steps (Optional[int]): overrides the run's own ``warmup_steps``.

    Returns:
        Dict[str, Any]: ``dir``, ``run`` (metadata), ``summary`` (recomputed from the steps;
        ``complete`` true only when ``summary.json`` was written by ``close()``), ``steps``
        (records), ``notes`` (e.g. truncated last line) and ``api`` (the API summary of a
        profile in the same folder, or None).

    Raises:
        RunReadError: unreadable ``run.json`` / ``summary.json`` or a corrupt steps line.
    """
    d = Path(run_dir)
    notes: List[str] = []
    run: Optional[Dict[str, Any]] = _read_json(d / RUN_FILE)
    if run is None:
        notes.append(f"{d / RUN_FILE} missing: metadata unknown")
        run = {}
    records: List[Dict[str, Any]] = []
    lost: List[str] = []  # steps.jsonl lines that could not be read
    if (d / STEPS_FILE).exists():
        records, lost = read_steps(d / STEPS_FILE)
    written: Optional[Dict[str, Any]] = _read_json(d / SUMMARY_FILE)
    w = warmup_steps if warmup_steps is not None else int(run.get("warmup_steps", 1) or 0)
    summary = summarize_steps(records, warmup_steps=w, world_size=int(run.get("world_size") or 1))
    # summary.json is written by close() only, from every line of steps.jsonl as it was then.
    complete = bool(written and written.get("complete"))
    if complete and lost and warmup_steps is None:
        # Lines of a finished run's log were lost afterwards (cut copy, disk error): its
        # summary, computed at close from the full log, is the better record.
        summary.update({k: v for k, v in written.items() if k != "schema"})
        closed = "run.json closed, " if run.get("status") == "closed" else ""
        lost = [f"{n}; the run closed normally ({closed}summary.json written at close): its summary.json is used"
                for n in lost]
    notes.extend(lost)
    summary["complete"] = complete
    if written is not None:
        summary["wall_time_s"] = written.get("wall_time_s")
    else:
        notes.append(f"{d / SUMMARY_FILE} missing: run killed or still running (partial record)")
    api = _read_json(d / API_SUMMARY_FILE, mapping=False)
    return {"dir": str(d), "run": run, "summary": summary, "steps": records, "notes": notes, "api": api}
