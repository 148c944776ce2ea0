"""``hlmtune collect``: many runs -> one scaling table (CSV + Markdown), problems, plots.

Rows are grouped by ``method, model, dataset, template, dtype, pin_memory, num_workers,
batch_size, gradient_accumulation_steps, max_seq_len, nodes, devices`` (repeated runs of one
row are averaged; ``n_runs`` says how many; ``batch_size`` is per device, ``max_seq_len`` the
tokenizer's). Each row is compared with a 1-device row of its *baseline group* (the same
``method ... num_workers`` and ``max_seq_len``): the one with the same global batch
(``batch_size x gradient_accumulation_steps x devices``, strong scaling), else the one with the
same per-device batch and accumulation (the papers' runs: every device keeps its batch and
the epoch is split), with the ECG paper's equations:

- ``speedup = T1 / TN``, ``efficiency = speedup / N``, ``overhead_s = TN - T1 / N``;
- **T is ``total_time_s``**: the training-loop time of the run (sum of the wall times of its
  optimizer steps, setup and checkpointing excluded), i.e. the time to finish the run's work.
  This comparison is only meaningful when both runs did the same work (the same epoch of the
  same data: same total tokens, or else the same number of samples); otherwise the run is
  listed as *mismatched* and these columns stay empty;
- per-iteration numbers that need no equal work: ``speedup_tput = tps_N / tps_1`` (steady
  state tokens/s, warmup excluded) and ``efficiency_tput = speedup_tput / N``.

Missing, partial and mismatched runs are listed in ``problems.md`` / ``problems.json`` and on
stderr with the reason, never dropped silently; a group without a 1-device run says so.
"""

from __future__ import annotations

import csv
import io
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hlmtune.profiling.runs import (
    RunReadError,
    atomic_write_json,
    atomic_write_text,
    find_run_dirs,
    load_run,
)

BATCH_KEYS = ("batch_size", "gradient_accumulation_steps", "max_seq_len")
GROUP_KEYS = ("method", "model", "dataset", "template", "dtype", "pin_memory", "num_workers", *BATCH_KEYS, "nodes", "devices")
BASELINE_KEYS = ("method", "model", "dataset", "template", "dtype", "pin_memory", "num_workers", "max_seq_len")
# Peak memory, two questions (see hlmtune.training.memory): the largest per-step peak
# ("over steps": setup and export excluded) and the process peak since start. Table column ->
# key in the step records.
MEMORY_COLUMNS = {
    f"peak_{what}_{scope}_gib": (f"peak_{what}_gib" if scope == "over_steps" else f"peak_{what}_since_start_gib")
    for what in ("memory_alloc", "memory_reserved", "memory_active", "rss")
    for scope in ("over_steps", "since_start")
}
VALUE_KEYS = (
    "steps",
    "iteration_time_s_mean",
    "iteration_time_s_median",
    "iteration_time_s_p90",
    "total_time_s",
    "tokens_total",
    "tokens_per_second",
    "tokens_per_second_per_gpu",
    *MEMORY_COLUMNS,
)
SCALING_KEYS = ("speedup", "efficiency", "overhead_s", "speedup_tput", "efficiency_tput", "baseline")
T_DEFINITION = (
    "T = total_time_s: training-loop time of the run (sum of optimizer-step wall times, "
    "setup and checkpointing excluded); speedup = T1/TN, efficiency = speedup/N, "
    "overhead_s = TN - T1/N, computed only when the N-device run did the same work as the "
    "1-device run. speedup_tput = steady-state tokens/s ratio (warmup excluded), "
    "efficiency_tput = speedup_tput/N."
)


def _mean(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    return sum(vals) / len(vals) if vals else None


def _max_over_records(steps: List[Dict[str, Any]], key: str) -> Optional[float]:
    vals = [r[key] for r in steps if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return max(vals) if vals else None


def _max_seq_len(meta: Dict[str, Any]) -> Optional[int]:
    """The run's sequence length: ``max_seq_len`` from the run info, else the tokenizer's in the config."""
    if meta.get("max_seq_len") is not None:
        return meta["max_seq_len"]
    tok = (meta.get("config") or {}).get("tokenizer")
    return tok.get("max_seq_len") if isinstance(tok, dict) else None


def _global_batch(row: Dict[str, Any]) -> Optional[int]:
    vals = [row.get(k) for k in ("batch_size", "gradient_accumulation_steps", "devices")]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        return vals[0] * vals[1] * vals[2]
    return None


def _run_work(run: Dict[str, Any], summary: Dict[str, Any]) -> Tuple[Optional[float], Optional[str]]:
    """Work done by a run: total tokens if logged, else samples (steps x batch x accum x devices)."""
    if summary.get("tokens_total") is not None:
        return float(summary["tokens_total"]), "tokens"
    b, g, w, s = run.get("batch_size"), run.get("gradient_accumulation_steps"), run.get("world_size"), summary.get("steps")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in (b, g, w, s)):
        return float(s * b * g * w), "samples"
    return None, None


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if not math.isfinite(v):
            return ""
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.6g}"
    return str(v)


def _headline_shares(api: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """Mean over ranks of each headline metric's share of its category total (percent)."""
    if not api:
        return {}
    per: Dict[str, List[float]] = {}
    for _rank, body in (api.get("ranks") or {}).items():
        for row in body.get("headline", []):
            if row.get("share") is not None:
                per.setdefault(row["name"], []).append(100.0 * row["share"])
    return {f"api_{name}_pct": sum(v) / len(v) for name, v in per.items()}


def build_table(
    runs: List[Dict[str, Any]],
    problems: List[Dict[str, str]],
    *,
    include_partial: bool = False,
    work_tolerance: float = 0.01,
) -> List[Dict[str, Any]]:
    """Group loaded runs into table rows with scaling columns.

    Args:
        runs (List[Dict[str, Any]]): results of :func:`hlmtune.profiling.runs.load_run`.
        problems (List[Dict[str, str]]): appended with every run or group that is left out or
            incomplete, with the reason.
        include_partial (bool): keep partial runs as rows (``status`` partial, no scaling).
        work_tolerance (float): relative difference in work (tokens / samples) above which a
            run is *mismatched* with its 1-device baseline.

    Returns:
        List[Dict[str, Any]]: rows (keys :data:`GROUP_KEYS`, ``n_runs``, :data:`VALUE_KEYS`,
        :data:`SCALING_KEYS`, ``api_*_pct``, ``status``, ``run_dirs``).
    """
    rows = [_row(key, members, problems, work_tolerance) for key, members in _group_runs(runs, problems, include_partial).items()]
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in BASELINE_KEYS), []).append(row)
    for gkey, grows in groups.items():
        _scale_group(gkey, grows, problems, work_tolerance)
    rows.sort(key=lambda r: tuple(str(r[k]) for k in BASELINE_KEYS + BATCH_KEYS) + (r["nodes"] if isinstance(r["nodes"], int) else 0, r["devices"] if isinstance(r["devices"], int) else 0))
    return rows


def _group_runs(runs: List[Dict[str, Any]], problems: List[Dict[str, str]], include_partial: bool) -> Dict[Tuple, List[Dict[str, Any]]]:
    """Usable runs by their :data:`GROUP_KEYS` values; every run left out is in ``problems``."""
    by_key: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        meta, s = r["run"], r["summary"]
        for note in r["notes"]:
            if "truncated" in note or "corrupt line" in note:  # a steps.jsonl line lost (runs.read_steps)
                kind = "lines lost" if s.get("complete") else "partial"
                problems.append({"path": r["dir"], "reason": f"{kind}: {note}"})
        if not s.get("complete"):
            reason = (
                f"partial: no summary.json (killed or still running); {s.get('steps', 0)} steps logged, "
                f"mean iteration {_fmt(s.get('iteration_time_s_mean'))} s"
            )
            problems.append({"path": r["dir"], "reason": reason})
            if not include_partial:
                continue
        if not r["steps"]:
            problems.append({"path": r["dir"], "reason": "missing: no step records in steps.jsonl"})
            continue
        if s.get("total_time_s") is None:
            problems.append({"path": r["dir"], "reason": "missing: no timed steps (iteration_time_s null everywhere)"})
            continue
        absent = [k for k in ("method", "model", "dataset", "world_size") if meta.get(k) in (None, "")]
        if absent:
            problems.append({"path": r["dir"], "reason": f"metadata incomplete: {', '.join(absent)} unknown (grouped as '?')"})
        key_vals = {k: meta.get(k) for k in GROUP_KEYS if k != "devices"}
        key_vals["max_seq_len"] = _max_seq_len(meta)
        key_vals["devices"] = meta.get("world_size")
        # Unknown values group as "?"; a run without a prompt template has template "none".
        key = tuple(("none" if k == "template" else "?") if key_vals[k] is None else key_vals[k] for k in GROUP_KEYS)
        by_key.setdefault(key, []).append(r)
    return by_key


def _row(key: Tuple, members: List[Dict[str, Any]], problems: List[Dict[str, str]], work_tolerance: float) -> Dict[str, Any]:
    """One table row: the mean of its runs' values, their work, API shares and run folders."""
    row: Dict[str, Any] = dict(zip(GROUP_KEYS, key))
    row["n_runs"] = len(members)
    row["status"] = "complete" if all(m["summary"].get("complete") for m in members) else "partial"
    for k in VALUE_KEYS:
        if k in MEMORY_COLUMNS:  # from the step records: the summary knows one name per peak
            row[k] = _mean([_max_over_records(m["steps"], MEMORY_COLUMNS[k]) for m in members])
        else:
            row[k] = _mean([m["summary"].get(k) for m in members])
    works = [_run_work(m["run"], m["summary"]) for m in members]
    row["_work"] = _mean([w for w, _ in works])
    kinds = {kind for _, kind in works if kind}
    row["_work_kind"] = kinds.pop() if len(kinds) == 1 else None
    shares: Dict[str, List[float]] = {}
    for m in members:
        for k, v in _headline_shares(m.get("api")).items():
            shares.setdefault(k, []).append(v)
    for k, v in shares.items():
        row[k] = sum(v) / len(v)
    row["run_dirs"] = ";".join(m["dir"] for m in members)
    # Repeats of one setting average into one measurement only when they did the same work
    # (a run of 8 steps and one of 16 are not one T): otherwise the row's T is no run's.
    done = [w for w, _ in works if w]
    row["_mixed_work"] = bool(done) and (max(done) - min(done)) / max(done) > work_tolerance
    if row["_mixed_work"]:
        problems.append({"path": row["run_dirs"], "reason": (
            f"mismatched: the {len(members)} runs of this row did different work ({min(done):.6g} to "
            f"{max(done):.6g} {row['_work_kind'] or 'units'}, > {100 * work_tolerance:g}% apart): their mean T "
            "is no run's; T-based speedup/efficiency/overhead left empty for it and against it")})
    return row


def _scale_group(gkey: Tuple, grows: List[Dict[str, Any]], problems: List[Dict[str, str]], work_tolerance: float) -> None:
    """Scaling columns of one baseline group's rows, against its complete 1-device rows."""
    ones = [r for r in grows if r["devices"] == 1 and r["status"] == "complete"]
    label = ", ".join(f"{k}={v}" for k, v in zip(BASELINE_KEYS, gkey))
    if not ones:
        for r in grows:
            r["baseline"] = "none: no complete 1-device run in this group"
        if any(r["devices"] != 1 for r in grows):
            problems.append({"path": label, "reason": "no 1-device baseline: speedup/efficiency/overhead not computed"})
        return
    for r in grows:
        same_global = [b for b in ones if _global_batch(b) is not None and _global_batch(b) == _global_batch(r)]
        same_local = [b for b in ones if all(b[k] == r[k] for k in ("batch_size", "gradient_accumulation_steps"))]
        b = r if any(r is o for o in ones) else (same_global or same_local or [None])[0]
        if b is None:
            r["baseline"] = "none: no 1-device run with the same global or per-device batch"
            problems.append({"path": r["run_dirs"], "reason": (
                f"no 1-device baseline with global batch {_global_batch(r)} or per-device batch "
                f"{r['batch_size']} x accumulation {r['gradient_accumulation_steps']} in group {label}")})
            continue
        kind = "same global batch" if any(b is g for g in same_global) else "same per-device batch"
        r["baseline"] = "self" if r is b else f"1-device row, {kind} ({b['n_runs']} run(s))"
        if r["status"] == "complete" and isinstance(r["devices"], int):
            _scale_row(r, b, problems, work_tolerance)


def _scale_row(r: Dict[str, Any], b: Dict[str, Any], problems: List[Dict[str, str]], work_tolerance: float) -> None:
    """``speedup_tput`` always; ``speedup`` / ``efficiency`` / ``overhead_s`` when ``r`` did ``b``'s work."""
    n = r["devices"]
    if b["tokens_per_second"] and r["tokens_per_second"] is not None:
        r["speedup_tput"] = r["tokens_per_second"] / b["tokens_per_second"]
        r["efficiency_tput"] = r["speedup_tput"] / n
    same_work = True
    if b["_work"] and r["_work"] is not None and b["_work_kind"] == r["_work_kind"]:
        rel = abs(r["_work"] - b["_work"]) / b["_work"]
        if rel > work_tolerance:
            same_work = False
            problems.append({
                "path": r["run_dirs"],
                "reason": (
                    f"mismatched: {n}-device run did {r['_work']:.6g} {r['_work_kind']} vs "
                    f"{b['_work']:.6g} for the 1-device run ({100 * rel:.1f}% apart > "
                    f"{100 * work_tolerance:g}%): T-based speedup/efficiency/overhead left empty"
                ),
            })
    elif r is not b:
        problems.append({"path": r["run_dirs"], "reason": "work not verified: tokens/samples unknown for this run or its baseline"})
    if same_work and r["total_time_s"] and not (r["_mixed_work"] or b["_mixed_work"]):
        t1, tn = b["total_time_s"], r["total_time_s"]
        r["speedup"] = t1 / tn
        r["efficiency"] = r["speedup"] / n
        r["overhead_s"] = tn - t1 / n


def table_columns(rows: List[Dict[str, Any]]) -> List[str]:
    """Column order: group keys, counts, values, scaling, API shares, status, run dirs."""
    api = sorted({k for r in rows for k in r if k.startswith("api_")})
    return list(GROUP_KEYS) + ["n_runs"] + list(VALUE_KEYS) + list(SCALING_KEYS) + api + ["status", "run_dirs"]


def to_csv(rows: List[Dict[str, Any]], columns: List[str]) -> str:
    """CSV text (full precision)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r.get(c) is None else r.get(c) for c in columns])
    return buf.getvalue()


def to_markdown(rows: List[Dict[str, Any]], columns: List[str], *, title: str = "", note: str = "") -> str:
    """Markdown table (4 significant digits)."""
    out = []
    if title:
        out.append(f"# {title}\n")
    if note:
        out.append(note + "\n")
    out.append("| " + " | ".join(columns) + " |")
    out.append("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c)).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(out) + "\n"


# table.md's first table: what a reader looks for first (table.csv keeps every column).
KEY_COLUMNS = (
    "nodes", "devices", "steps", "iteration_time_s_mean", "tokens_per_second",
    "peak_memory_alloc_over_steps_gib", "peak_rss_over_steps_gib",
    "speedup", "efficiency", "overhead_s", "speedup_tput", "efficiency_tput",
)


def _has_values(rows: List[Dict[str, Any]], column: str) -> bool:
    return any(r.get(column) not in (None, "") for r in rows)


def compact_markdown(rows: List[Dict[str, Any]], columns: List[str], *, title: str = "", note: str = "") -> str:
    """``table.md``: the key figures first, then the other columns that have a value.

    Group keys equal in every row are said once above the tables; the ones that differ
    identify each row in both tables. Columns empty in every row (CUDA memory on CPU) and the
    run folders' paths stay in ``table.csv`` only.

    Args:
        rows (List[Dict[str, Any]]): table rows.
        columns (List[str]): every column, in :func:`table_columns` order.
        title (str): the page's heading.
        note (str): a paragraph under it.

    Returns:
        str: Markdown text.
    """
    filled = [c for c in columns if c != "run_dirs" and _has_values(rows, c)]
    group = [c for c in GROUP_KEYS if c in filled and c not in KEY_COLUMNS]
    varying = [c for c in group if len({str(r.get(c)) for r in rows}) > 1]
    shared = [c for c in group if c not in varying]
    key = varying + [c for c in KEY_COLUMNS if c in filled]
    rest = [c for c in filled if c not in key and c not in shared]
    out = [f"# {title}\n"] if title else []
    if shared and rows:
        out.append("All rows: " + ", ".join(f"{c}={_fmt(rows[0].get(c))}" for c in shared) + ".\n")
    out.append(to_markdown(rows, key, title="", note="").rstrip("\n") + "\n")
    if rest:
        ids = varying + [c for c in ("nodes", "devices") if c in filled]
        out.append("\n## Other columns\n")
        out.append(to_markdown(rows, ids + rest).rstrip("\n") + "\n")
    out.append(f"\n{note}\n" if note else "")
    out.append("\nEvery column, and each row's run folders: `table.csv`.\n")
    return "\n\n".join(x.strip("\n") for x in out if x.strip()) + "\n"


def api_long_rows(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per-rank API rows of every run that has an ``api_summary.json`` (long format)."""
    out = []
    for r in runs:
        api = r.get("api")
        if not api:
            continue
        meta = r["run"]
        for rank, body in sorted((api.get("ranks") or {}).items()):
            for section in ("headline", "rows"):
                for row in body.get(section, []):
                    out.append({
                        "run": meta.get("run_name") or Path(r["dir"]).name,
                        "devices": meta.get("world_size"),
                        "source": api.get("source"),
                        "rank": rank,
                        "section": section,
                        **{k: row.get(k) for k in ("category", "name", "seconds", "share", "calls", "bytes")},
                    })
    return out


def collect(
    paths: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    warmup_steps: Optional[int] = None,
    include_partial: bool = False,
    work_tolerance: float = 0.01,
    plots: bool = True,
) -> Dict[str, Any]:
    """Read run directories and write ``table.csv``, ``table.md``, ``problems.md/json``, plots, ``report.md``.

    Args:
        paths (Sequence[str | os.PathLike]): run directories or parents holding many.
        out (str | os.PathLike): output directory.
        warmup_steps (Optional[int]): overrides each run's own warmup.
        include_partial (bool): keep partial runs as rows (never used for scaling).
        work_tolerance (float): see :func:`build_table`.
        plots (bool): also write the PNG plots.

    Returns:
        Dict[str, Any]: ``rows``, ``problems``, ``api_rows``, ``files`` (written paths).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dirs, problems = find_run_dirs(paths)
    runs = []
    for d in dirs:
        try:
            runs.append(load_run(d, warmup_steps=warmup_steps))
        except (RunReadError, OSError) as e:
            problems.append({"path": str(d), "reason": f"unreadable: {e}"})
    rows = build_table(runs, problems, include_partial=include_partial, work_tolerance=work_tolerance)
    cols = table_columns(rows)
    files = []
    atomic_write_text(out / "table.csv", to_csv(rows, cols))
    atomic_write_text(out / "table.md", compact_markdown(rows, cols, title="hlmtune collect", note=T_DEFINITION))
    files += [out / "table.csv", out / "table.md"]
    api_rows = api_long_rows(runs)
    if api_rows:
        acols = ["run", "devices", "source", "rank", "section", "category", "name", "seconds", "share", "calls", "bytes"]
        atomic_write_text(out / "api_table.csv", to_csv(api_rows, acols))
        atomic_write_text(out / "api_table.md", to_markdown(api_rows, acols, title="API summaries (per rank)",
                                                            note="share = fraction of the category total (CUDA API time, GPU kernel time, GPU memop time, or profiled CPU time)."))
        files += [out / "api_table.csv", out / "api_table.md"]
    atomic_write_json(out / "problems.json", problems)
    md = ["# Problems\n"] + ([f"- `{p['path']}`: {p['reason']}" for p in problems] or ["None."])
    atomic_write_text(out / "problems.md", "\n".join(md) + "\n")
    files += [out / "problems.json", out / "problems.md"]
    if plots and rows:
        from hlmtune.profiling.plots import write_plots

        files += write_plots(rows, api_rows, out)
    if rows:
        from hlmtune.profiling.report import scaling_report_markdown

        atomic_write_text(out / "report.md", scaling_report_markdown(rows, problems, files, t_definition=T_DEFINITION))
        files.append(out / "report.md")
    return {"rows": rows, "problems": problems, "api_rows": api_rows, "files": [str(f) for f in files]}


def main_collect(args: Any) -> int:
    """``hlmtune collect`` entry point (see ``profiling/cli.py``).

    Returns:
        int: 0; 1 when some run could not be read at all (the others are tabled); 2 when
        there is nothing to table (no run directory: nothing is written) or ``--out`` is a file.
    """
    from hlmtune.files import OutputPathError, check_dir_path

    try:
        check_dir_path(args.out, "--out")
    except OutputPathError as e:
        print(f"hlmtune collect: error: {e}", file=sys.stderr)
        return 2
    dirs, problems = find_run_dirs(args.run_dirs)
    if not dirs:
        for p in problems:
            print(f"problem: {p['path']}: {p['reason']}", file=sys.stderr)
        print(f"hlmtune collect: error: no run directory found (folders with run.json or steps.jsonl); "
              f"nothing written to {args.out}", file=sys.stderr)
        return 2
    res = collect(
        args.run_dirs,
        args.out,
        warmup_steps=args.warmup_steps,
        include_partial=args.include_partial,
        work_tolerance=args.work_tolerance,
        plots=not args.no_plots,
    )
    rows, problems = res["rows"], res["problems"]
    print(f"{len(rows)} row(s) from {sum(r['n_runs'] for r in rows)} run(s) -> {args.out}")
    for f in res["files"]:
        print(f"  wrote {f}")
    for p in problems:
        print(f"problem: {p['path']}: {p['reason']}", file=sys.stderr)
    if not rows:
        print("hlmtune collect: error: no usable run (see problems above)", file=sys.stderr)
        return 2
    lost = [p for p in problems if p["reason"].startswith("unreadable")]
    if lost:
        print(f"hlmtune collect: error: {len(lost)} run(s) lost: unreadable (see problems above); the table holds the others", file=sys.stderr)
        return 1
    return 0
