"""Nsight Systems: the profiling command, and parsers for ``nsys stats`` CSV and SQLite exports.

Formats (NVIDIA Nsight Systems, "Post-Collection Analysis Guide", statistical reports;
``nsys stats --format csv --output PREFIX`` writes ``PREFIX_<report>.csv``; time unit ns
unless ``--timeunit`` is given, which changes the ``(ns)`` suffix):

===================== =======================================================================
report                columns
===================== =======================================================================
cuda_api_sum          Time (%), Total Time (ns), Num Calls, Avg (ns), Med (ns), Min (ns),
                      Max (ns), StdDev (ns), Name
cuda_gpu_kern_sum     Time (%), Total Time (ns), Instances, Avg (ns), Med (ns), Min (ns),
                      Max (ns), StdDev (ns), Name
cuda_gpu_mem_time_sum Time (%), Total Time (ns), Count, Avg (ns), Med (ns), Min (ns),
                      Max (ns), StdDev (ns), Operation
cuda_gpu_mem_size_sum Total (MB), Count, Avg (MB), Med (MB), Min (MB), Max (MB),
                      StdDev (MB), Operation
===================== =======================================================================

Report names: later releases call them as above; Nsight Systems 2022.4.2 (the Debian bookworm
``nsight-systems`` package, run here to write ``tests/fixtures/nsys/nsys_2022.4.2``) still calls
them ``cudaapisum``, ``gpukernsum``, ``gpumemtimesum``, ``gpumemsizesum`` but already prints the
columns above (its kernel summary adds ``GridXYZ``, ``BlockXYZ`` before ``Name``; it strips API
version suffixes such as ``_v7000`` itself). Older releases printed ``Time(%)``, ``Calls`` /
``Operations``, ``Average``, ``Minimum``, ``Maximum`` and sizes in KiB (``Total``); every
spelling is accepted. Memory operations are ``[CUDA memcpy HtoD]`` (2022.4; later:
``[CUDA memcpy Host-to-Device]``), ``DtoH``, ``DtoD``, ``PtoP``, ``[CUDA memset]``. MB in these
reports is 10^6 bytes, printed with 3 decimals (a few bytes read as 0.000).

SQLite export (``nsys export --type sqlite``; ``nsys stats`` writes it next to the report):
``StringIds(id, value)``, ``CUPTI_ACTIVITY_KIND_RUNTIME(start, end, nameId, globalTid)``,
``CUPTI_ACTIVITY_KIND_KERNEL(start, end, shortName, demangledName, globalPid)``,
``CUPTI_ACTIVITY_KIND_MEMCPY(start, end, bytes, copyKind, globalPid)``; copyKind is CUPTI's
``CUpti_ActivityMemcpyKind`` (1 HtoD, 2 DtoH, 8 DtoD, 10 PtoP); the process id is bits 24..47
of ``globalTid`` / ``globalPid``.

Output of :func:`summarize` / ``api_summary.json``: per rank, rows of ``category`` (cuda_api,
gpu_kernel, gpu_memop), ``name``, ``seconds``, ``share`` (fraction of the category total),
``calls`` and ``bytes``; ``headline`` rows hold the papers' metrics.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from hlmtune.profiling.runs import API_SUMMARY_FILE, atomic_write_json, profiled_command

STATS_REPORTS = ("cuda_api_sum", "cuda_gpu_kern_sum", "cuda_gpu_mem_time_sum", "cuda_gpu_mem_size_sum")
_OLD_REPORT_NAMES = {"cudaapisum": "cuda_api_sum", "gpukernsum": "cuda_gpu_kern_sum",
                     "gpumemtimesum": "cuda_gpu_mem_time_sum", "gpumemsizesum": "cuda_gpu_mem_size_sum"}
HEADLINE_API = ("cudaLaunchKernel", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaEventDestroy", "cudaMemcpyAsync")
HEADLINE_MEMOPS = ("memcpy_HtoD", "memcpy_DtoH", "memcpy_DtoD")
HEADLINE_NCCL = ("nccl_AllGather", "nccl_ReduceScatter", "nccl_AllReduce")

_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
# Decimal MB in current reports; the pre-2021 gpumemsizesum used KiB with a bare "Total".
_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1024**2, "gib": 1024**3}
# CUPTI's names end in a version and, for per-thread default streams, _ptsz / _ptds, in either
# order (cudaLaunchKernel_ptsz_v7000, cudaMemcpyAsync_v3020_ptds): every such suffix goes.
_API_SUFFIX = re.compile(r"(?:_v\d+|_ptsz|_ptds)+$")
_NCCL = re.compile(r"nccl[A-Za-z]*?_?(AllGather|ReduceScatter|AllReduce|Broadcast|SendRecv|Reduce)")
_MEMOP = {
    "host-to-device": "memcpy_HtoD", "htod": "memcpy_HtoD",
    "device-to-host": "memcpy_DtoH", "dtoh": "memcpy_DtoH",
    "device-to-device": "memcpy_DtoD", "dtod": "memcpy_DtoD",
    "peer-to-peer": "memcpy_PtoP", "ptop": "memcpy_PtoP",
}
# CUpti_ActivityMemcpyKind (CUPTI docs).
_COPY_KIND = {1: "memcpy_HtoD", 2: "memcpy_DtoH", 3: "memcpy_HtoA", 4: "memcpy_AtoH", 5: "memcpy_AtoA",
              6: "memcpy_AtoD", 7: "memcpy_DtoA", 8: "memcpy_DtoD", 9: "memcpy_HtoH", 10: "memcpy_PtoP"}


class NsysFormatError(ValueError):
    """An nsys output that does not have the documented layout (message names the file)."""


# ---------------------------------------------------------------------------- names
def normalize_api_name(name: str) -> str:
    """``cudaLaunchKernel_v7000`` -> ``cudaLaunchKernel``; ``cudaMemcpyAsync_ptsz`` -> ``cudaMemcpyAsync``."""
    return _API_SUFFIX.sub("", name.strip())


def normalize_memop(op: str) -> str:
    """``[CUDA memcpy Host-to-Device]`` / ``[CUDA memcpy HtoD]`` -> ``memcpy_HtoD``; memset -> ``memset``."""
    s = op.strip().strip("[]").lower()
    if "memset" in s:
        return "memset"
    for key, name in _MEMOP.items():
        if key in s:
            return name
    return s.replace("cuda ", "").replace(" ", "_")


def nccl_collective(kernel: str) -> Optional[str]:
    """``ncclDevKernel_AllGather_RING_LL(...)`` -> ``nccl_AllGather``; None for non-NCCL kernels."""
    m = _NCCL.search(kernel)
    return f"nccl_{m.group(1)}" if m else None


# ------------------------------------------------------------------------------ CSV
def _col_key(col: str) -> Tuple[str, Optional[str]]:
    """``'Total Time (ns)'`` -> (``'total time'``, ``'ns'``); ``'Time(%)'`` -> (``'time'``, ``'%'``)."""
    m = re.match(r"^\s*(.*?)\s*(?:\(([^)]*)\))?\s*$", col)
    base, unit = (m.group(1), m.group(2)) if m else (col, None)
    return base.strip().lower(), (unit.strip().lower() if unit else None)


def _num(cell: str, where: str) -> float:
    try:
        return float(cell.replace(",", "").strip())
    except ValueError:
        raise NsysFormatError(f"{where}: expected a number, got {cell!r}") from None


def _report_kind(cols: Dict[str, Tuple[int, Optional[str]]], path: str) -> str:
    name_col = "name" if "name" in cols else ("operation" if "operation" in cols else None)
    if name_col is None:
        raise NsysFormatError(f"{path}: no 'Name' or 'Operation' column (got {sorted(cols)})")
    if name_col == "name":
        if "instances" in cols:
            return "cuda_gpu_kern_sum"
        if "num calls" in cols or "calls" in cols:
            return "cuda_api_sum"
        stem = Path(path).stem
        for old, new in _OLD_REPORT_NAMES.items():
            if stem.endswith(old):
                return new
        for rep in STATS_REPORTS:
            if stem.endswith(rep):
                return rep
        raise NsysFormatError(f"{path}: a Name column but neither 'Num Calls' nor 'Instances'")
    if "total time" in cols:
        return "cuda_gpu_mem_time_sum"
    if "total" in cols:
        return "cuda_gpu_mem_size_sum"
    raise NsysFormatError(f"{path}: an Operation column but neither 'Total Time' nor 'Total'")


def parse_stats_csv(text: str, path: str = "<csv>") -> Tuple[str, List[Dict[str, Any]]]:
    """Parse one ``nsys stats --format csv`` report.

    Lines before the header (``nsys stats`` banners such as ``** CUDA API Summary
    (cuda_api_sum):`` or ``Processing [...]``) are skipped.

    Args:
        text (str): file content.
        path (str): file name for error messages.

    Returns:
        Tuple[str, List[Dict[str, Any]]]: the report kind (one of :data:`STATS_REPORTS`) and
        rows with ``name`` (raw), ``seconds`` (or None), ``calls``, ``bytes`` (or None).

    Raises:
        NsysFormatError: no recognizable header, or a non-numeric cell (names file and row).
    """
    rows = list(csv.reader(io.StringIO(text)))
    header_i = None
    for i, row in enumerate(rows):
        keys = {_col_key(c)[0] for c in row}
        if ("name" in keys or "operation" in keys) and ({"total time", "total"} & keys):
            header_i = i
            break
    if header_i is None:
        if not any(r for r in rows if any(c.strip() for c in r)):
            return "empty", []  # nsys writes nothing (or only a banner) when a report has no data
        raise NsysFormatError(f"{path}: no nsys stats header row (a row with Name/Operation and Total Time/Total)")
    cols = {}
    for j, c in enumerate(rows[header_i]):
        base, unit = _col_key(c)
        cols[base] = (j, unit)
    kind = _report_kind(cols, path)
    name_j = cols["name" if "name" in cols else "operation"][0]
    calls_j = None
    for k in ("num calls", "calls", "instances", "count", "operations"):
        if k in cols:
            calls_j = cols[k][0]
            break
    out = []
    for i, row in enumerate(rows[header_i + 1 :], start=header_i + 2):
        if not row or not any(c.strip() for c in row):
            continue
        if len(row) <= name_j:
            raise NsysFormatError(f"{path}: row {i} has {len(row)} cells, expected {len(rows[header_i])}")
        where = f"{path}: row {i}"
        rec: Dict[str, Any] = {"name": row[name_j], "seconds": None, "bytes": None, "calls": None}
        if calls_j is not None:
            rec["calls"] = int(_num(row[calls_j], where))
        if kind == "cuda_gpu_mem_size_sum":
            j, unit = cols["total"]
            rec["bytes"] = _num(row[j], where) * _SIZE_UNITS.get(unit or "kib", 1024)
        else:
            j, unit = cols["total time"]
            if (unit or "ns") not in _TIME_UNITS:
                raise NsysFormatError(f"{path}: unknown time unit {unit!r} in 'Total Time'")
            rec["seconds"] = _num(row[j], where) * _TIME_UNITS[unit or "ns"]
        out.append(rec)
    return kind, out


def _rank_of(path: Path) -> str:
    m = re.search(r"rank[_-]?(\d+)", path.name)
    return m.group(1) if m else "all"


def parse_stats_files(paths: Iterable[str | os.PathLike]) -> Dict[str, Dict[str, List[Dict[str, Any]]]]:
    """Parse many CSV reports; the rank comes from ``rank<N>`` in the file name (else ``all``).

    Args:
        paths (Iterable[str | os.PathLike]): CSV files.

    Returns:
        Dict[str, Dict[str, List[Dict[str, Any]]]]: rank -> report kind -> rows.
    """
    out: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for p in paths:
        p = Path(p)
        kind, rows = parse_stats_csv(p.read_text(encoding="utf-8", errors="replace"), str(p))
        if kind == "empty":
            continue
        out.setdefault(_rank_of(p), {}).setdefault(kind, []).extend(rows)
    return out


# --------------------------------------------------------------------------- SQLite
def _pid(global_id: Optional[int]) -> Optional[int]:
    # nsys packs the process id in bits 24..47 of globalTid / globalPid.
    return None if global_id is None else (int(global_id) >> 24) & 0xFFFFFF


def parse_sqlite(path: str | os.PathLike) -> Dict[str, Dict[str, List[Dict[str, Any]]]]:
    """Aggregate an nsys SQLite export into the same shape as :func:`parse_stats_files`.

    One report traced a whole process tree (e.g. ``nsys profile torchrun ...``): processes
    with CUDA activity become ranks ``0..n-1`` in the order of their first activity (torchrun
    starts local ranks in order); with a single process the rank comes from the file name.

    Args:
        path (str | os.PathLike): the ``.sqlite`` file.

    Returns:
        Dict[str, Dict[str, List[Dict[str, Any]]]]: rank -> report kind -> rows; each rank
        dict also holds ``"_pid"`` -> [{"pid": ...}].

    Raises:
        NsysFormatError: not an nsys export (no ``StringIds`` table), or an export without
            CUDA trace data (no ``CUPTI_ACTIVITY_KIND_*`` table).
    """
    path = Path(path)
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = _trace_tables(con, path)
        agg, first = _aggregate_activity(con, tables)
    finally:
        con.close()
    pids = sorted(agg, key=lambda p: first[p])
    out: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for i, pid in enumerate(pids):
        rank = _rank_of(path) if len(pids) == 1 else str(i)
        body: Dict[str, List[Dict[str, Any]]] = {"_pid": [{"pid": pid}]}
        for kind, names in agg[pid].items():
            body[kind] = [
                {"name": n, "seconds": None if kind == "cuda_gpu_mem_size_sum" else s, "calls": int(c),
                 "bytes": b if kind == "cuda_gpu_mem_size_sum" else None}
                for n, (s, c, b) in names.items()
            ]
        out[rank] = body
    return out


def _trace_tables(con: sqlite3.Connection, path: Path) -> set:
    """The export's table names, after checking it is an nsys export with CUDA trace data."""
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as e:  # a corrupt or foreign file: named, not a traceback
        raise NsysFormatError(f"{path}: not an SQLite database ({e})") from None
    if "StringIds" not in tables:
        raise NsysFormatError(f"{path}: no StringIds table: not an nsys SQLite export")
    if not any(t.startswith("CUPTI_ACTIVITY_KIND_") for t in tables):
        # What nsys stats itself answers ("does not contain CUDA trace data"): e.g. a run
        # profiled without -t cuda, or on a machine without a GPU.
        raise NsysFormatError(f"{path}: no CUDA trace data (no CUPTI_ACTIVITY_KIND_* table): "
                              "profile on a GPU with nsys profile -t cuda")
    return tables


def _aggregate_activity(con: sqlite3.Connection, tables: set) -> Tuple[Dict[Optional[int], Dict[str, Dict[str, List[float]]]], Dict[Optional[int], int]]:
    """Per pid: report kind -> name -> [seconds, calls, bytes]; and each pid's first activity time (ns)."""
    strings = dict(con.execute("SELECT id, value FROM StringIds"))

    def cols(t: str) -> set:
        return {r[1] for r in con.execute(f"PRAGMA table_info({t})")}

    agg: Dict[Optional[int], Dict[str, Dict[str, List[float]]]] = {}
    first: Dict[Optional[int], int] = {}

    def add(pid, kind, name, dur_ns, nbytes, start):
        slot = agg.setdefault(pid, {}).setdefault(kind, {}).setdefault(name, [0.0, 0, None])
        slot[0] += dur_ns * 1e-9
        slot[1] += 1
        if nbytes is not None:
            slot[2] = (slot[2] or 0) + nbytes
        first[pid] = min(first.get(pid, start), start)

    t = "CUPTI_ACTIVITY_KIND_RUNTIME"
    if t in tables:
        tid = "globalTid" if "globalTid" in cols(t) else "NULL"
        for start, end, name_id, g in con.execute(f"SELECT start, end, nameId, {tid} FROM {t}"):
            add(_pid(g), "cuda_api_sum", strings.get(name_id, str(name_id)), end - start, None, start)
    t = "CUPTI_ACTIVITY_KIND_KERNEL"
    if t in tables:
        c = cols(t)
        name_col = "demangledName" if "demangledName" in c else "shortName"
        gp = "globalPid" if "globalPid" in c else "NULL"
        for start, end, name_id, g in con.execute(f"SELECT start, end, {name_col}, {gp} FROM {t}"):
            add(_pid(g), "cuda_gpu_kern_sum", strings.get(name_id, str(name_id)), end - start, None, start)
    t = "CUPTI_ACTIVITY_KIND_MEMCPY"
    if t in tables:
        gp = "globalPid" if "globalPid" in cols(t) else "NULL"
        for start, end, nbytes, kind, g in con.execute(f"SELECT start, end, bytes, copyKind, {gp} FROM {t}"):
            name = _COPY_KIND.get(int(kind), f"memcpy_kind{kind}")
            add(_pid(g), "cuda_gpu_mem_time_sum", name, end - start, None, start)
            add(_pid(g), "cuda_gpu_mem_size_sum", name, 0, nbytes, start)
    t = "CUPTI_ACTIVITY_KIND_MEMSET"
    if t in tables:
        gp = "globalPid" if "globalPid" in cols(t) else "NULL"
        for start, end, nbytes, g in con.execute(f"SELECT start, end, bytes, {gp} FROM {t}"):
            add(_pid(g), "cuda_gpu_mem_time_sum", "memset", end - start, None, start)
            add(_pid(g), "cuda_gpu_mem_size_sum", "memset", 0, nbytes, start)
    return agg, first


# --------------------------------------------------------------------------- summary
def summarize(parsed: Dict[str, Dict[str, List[Dict[str, Any]]]], *, source: str, inputs: Sequence[str] = (),
              top: int = 15) -> Dict[str, Any]:
    """Per-rank rows and the papers' headline metrics from parsed reports.

    Shares are fractions of the category total: CUDA API time (all API calls), GPU kernel
    time (all kernels), GPU memop time (all memcpy/memset operations).

    Args:
        parsed (Dict[str, Dict[str, List[Dict[str, Any]]]]): from :func:`parse_stats_files` or
            :func:`parse_sqlite`.
        source (str): ``nsys-csv`` or ``nsys-sqlite``.
        inputs (Sequence[str]): input files (recorded).
        top (int): rows kept per category (headline rows are always kept).

    Returns:
        Dict[str, Any]: the ``api_summary.json`` content.
    """
    ranks: Dict[str, Any] = {}
    for rank, kinds in sorted(parsed.items()):
        api: Dict[str, List[float]] = {}
        for r in kinds.get("cuda_api_sum", []):
            slot = api.setdefault(normalize_api_name(r["name"]), [0.0, 0])
            slot[0] += r["seconds"] or 0.0
            slot[1] += r["calls"] or 0
        kern: Dict[str, List[float]] = {}
        nccl: Dict[str, List[float]] = {}
        for r in kinds.get("cuda_gpu_kern_sum", []):
            slot = kern.setdefault(r["name"], [0.0, 0])
            slot[0] += r["seconds"] or 0.0
            slot[1] += r["calls"] or 0
            coll = nccl_collective(r["name"])
            if coll:
                s2 = nccl.setdefault(coll, [0.0, 0])
                s2[0] += r["seconds"] or 0.0
                s2[1] += r["calls"] or 0
        mem: Dict[str, List[Any]] = {}
        for r in kinds.get("cuda_gpu_mem_time_sum", []):
            slot = mem.setdefault(normalize_memop(r["name"]), [0.0, 0, None])
            slot[0] += r["seconds"] or 0.0
            slot[1] += r["calls"] or 0
        for r in kinds.get("cuda_gpu_mem_size_sum", []):
            slot = mem.setdefault(normalize_memop(r["name"]), [None, r["calls"] or 0, None])
            slot[2] = (slot[2] or 0.0) + (r["bytes"] or 0.0)
        totals = {
            "cuda_api": sum(v[0] for v in api.values()),
            "gpu_kernel": sum(v[0] for v in kern.values()),
            "gpu_memop": sum(v[0] or 0.0 for v in mem.values()),
        }

        def share(x: Optional[float], cat: str) -> Optional[float]:
            return x / totals[cat] if x is not None and totals[cat] > 0 else None

        rows: List[Dict[str, Any]] = []
        for name, (s, c) in sorted(api.items(), key=lambda kv: -kv[1][0])[:top]:
            rows.append({"category": "cuda_api", "name": name, "seconds": s, "share": share(s, "cuda_api"), "calls": c, "bytes": None})
        for name, (s, c) in sorted(kern.items(), key=lambda kv: -kv[1][0])[:top]:
            rows.append({"category": "gpu_kernel", "name": name, "seconds": s, "share": share(s, "gpu_kernel"), "calls": c, "bytes": None})
        for name, (s, c, b) in sorted(mem.items(), key=lambda kv: -(kv[1][0] or 0))[:top]:
            rows.append({"category": "gpu_memop", "name": name, "seconds": s, "share": share(s, "gpu_memop"), "calls": c, "bytes": b})
        headline: List[Dict[str, Any]] = []
        for name in HEADLINE_API:
            s, c = api.get(name, [0.0, 0])
            headline.append({"category": "cuda_api", "name": name, "seconds": s, "share": share(s, "cuda_api"), "calls": c, "bytes": None})
        for name in HEADLINE_MEMOPS:
            s, c, b = mem.get(name, [0.0, 0, 0.0])
            headline.append({"category": "gpu_memop", "name": name, "seconds": s or 0.0, "share": share(s or 0.0, "gpu_memop"), "calls": c, "bytes": b or 0.0})
        for name in HEADLINE_NCCL:
            s, c = nccl.get(name, [0.0, 0])
            headline.append({"category": "gpu_kernel", "name": name, "seconds": s, "share": share(s, "gpu_kernel"), "calls": c, "bytes": None})
        body = {"totals": totals, "headline": headline, "rows": rows}
        if "_pid" in kinds:
            body["pid"] = kinds["_pid"][0]["pid"]
        ranks[rank] = body
    return {"schema": "hlmtune.api_summary/1", "source": source, "inputs": list(inputs),
            "ranks": ranks, "time_unit": "s", "share": "fraction of the category total"}


def summarize_path(paths: Sequence[str | os.PathLike]) -> Dict[str, Any]:
    """Summarize nsys outputs: ``.sqlite`` files and/or ``*.csv`` stats (files or folders).

    SQLite is used when present (it splits processes); otherwise the CSV reports.

    Args:
        paths (Sequence[str | os.PathLike]): files or folders.

    Returns:
        Dict[str, Any]: the ``api_summary.json`` content.

    Raises:
        NsysFormatError: nothing parsable found.
    """
    files: List[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.sqlite")) + sorted(p.glob("*.csv"))  # not recursive: one report set per folder
        elif p.exists():
            files.append(p)
        else:
            raise NsysFormatError(f"{p}: does not exist")
    sqlites = [f for f in files if f.suffix == ".sqlite"]
    csvs = [f for f in files if f.suffix == ".csv"]
    if sqlites:
        parsed: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
        for f in sqlites:
            for rank, body in parse_sqlite(f).items():
                key = rank if rank not in parsed else f"{rank}:{f.stem}"
                parsed[key] = body
        return summarize(parsed, source="nsys-sqlite", inputs=[str(f) for f in sqlites])
    if csvs:
        return summarize(parse_stats_files(csvs), source="nsys-csv", inputs=[str(f) for f in csvs])
    raise NsysFormatError(f"no nsys .sqlite or .csv reports under {', '.join(map(str, paths))}")


# --------------------------------------------------------------------------- commands
def report_name() -> str:
    """``report_rank<RANK>`` when this process is one rank (srun/torchrun per rank), else ``report``."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    return f"report_rank{rank}" if rank not in (None, "") else "report"


def build_profile_command(cmd: Sequence[str], out_dir: str | os.PathLike, *, window_s: Optional[float] = None,
                          delay_s: Optional[float] = None, trace: str = "cuda,nvtx,osrt",
                          kill_app: bool = False, nsys: str = "nsys") -> List[str]:
    """The ``nsys profile`` command line (a list for ``subprocess``, never a shell string).

    Args:
        cmd (Sequence[str]): the training command (``hlmtune run ...`` / ``tune run ...``).
        out_dir (str | os.PathLike): folder for the report.
        window_s (Optional[float]): collection duration in seconds (``--duration``); the
            papers profiled the first 720 s.
        delay_s (Optional[float]): seconds to wait before collecting (``--delay``).
        trace (str): ``--trace`` APIs.
        kill_app (bool): with a window, let nsys stop the application when the window ends
            (its default, SIGTERM). Default False: ``--kill none``, training runs to the end and
            its collector record stays complete.
        nsys (str): the nsys executable.

    Returns:
        List[str]: the command.
    """
    if not cmd:
        raise ValueError("no command to profile: put it after `--`")
    out = [nsys, "profile", f"--trace={trace}", "--sample=none", "--cpuctxsw=none",
           "--force-overwrite=true", "--output", str(Path(out_dir) / report_name())]
    if delay_s:
        out += ["--delay", str(int(round(delay_s)))]
    if window_s:
        out += ["--duration", str(int(round(window_s)))]
        if not kill_app:
            out += ["--kill", "none"]
    return out + list(cmd)


def stats_reports_for(help_reports: str) -> Tuple[str, ...]:
    """The report names this nsys knows, from its ``nsys stats --help-reports`` text.

    Nsight Systems 2022.4 lists ``cudaapisum`` ... and answers ``Report 'cuda_api_sum' could
    not be found`` (with exit status 0) to the later names; later releases list ``cuda_api_sum``.

    Args:
        help_reports (str): output of ``nsys stats --help-reports``.

    Returns:
        Tuple[str, ...]: :data:`STATS_REPORTS` or their older names, in the same order.
    """
    listed = set(re.findall(r"^\s*([a-z_]+)", help_reports, flags=re.M))
    if STATS_REPORTS[0] not in listed and "cudaapisum" in listed:
        old = {v: k for k, v in _OLD_REPORT_NAMES.items()}
        return tuple(old[r] for r in STATS_REPORTS)
    return STATS_REPORTS


def build_stats_command(report: str | os.PathLike, out_prefix: str | os.PathLike, *, nsys: str = "nsys",
                        reports: Sequence[str] = STATS_REPORTS) -> List[str]:
    """``nsys stats`` writing ``<out_prefix>_<report>.csv`` for ``reports`` (:func:`stats_reports_for`)."""
    return [nsys, "stats", "--report", ",".join(reports), "--format", "csv",
            "--output", str(out_prefix), "--force-export=true", str(report)]


def run_nsys(args: Any) -> int:
    """``hlmtune profile nsys`` entry point."""
    cmd = profiled_command(args.cmd, "nsys")
    if cmd is None:
        return 2
    out = Path(args.out)
    prof = build_profile_command(cmd, out, window_s=args.window_s, delay_s=args.delay_s, trace=args.trace,
                                 kill_app=args.stop_app)
    report = out / (report_name() + ".nsys-rep")
    stats = build_stats_command(report, out / "stats" / report_name())
    if args.dry_run:
        print(shlex.join(prof))
        print(shlex.join(stats))
        return 0
    exe = shutil.which("nsys")
    if exe is None:
        print("hlmtune profile nsys: error: `nsys` (NVIDIA Nsight Systems CLI) is not on PATH. Install Nsight Systems or load "
              "its module (e.g. `module load nsight-systems`), or use `hlmtune profile torch` on CPU. "
              f"Command that would run: {shlex.join(prof)}", file=sys.stderr)
        return 2
    help_text = subprocess.run([exe, "stats", "--help-reports"], capture_output=True, text=True)
    stats = build_stats_command(report, out / "stats" / report_name(),
                                reports=stats_reports_for(help_text.stdout + help_text.stderr))
    out.mkdir(parents=True, exist_ok=True)
    (out / "stats").mkdir(exist_ok=True)
    # The pack recipes always emit NVTX ranges (data/forward/backward/optimizer_step) on CUDA.
    print("+ " + shlex.join(prof), file=sys.stderr)
    rc = subprocess.run(prof).returncode
    if not report.exists():
        legacy = report.with_suffix(".qdrep")
        if legacy.exists():
            report = legacy
            stats[-1] = str(report)
        else:
            print(f"hlmtune profile nsys: error: nsys exited with {rc} and wrote no report at {report}", file=sys.stderr)
            return rc or 2
    print("+ " + shlex.join(stats), file=sys.stderr)
    src = subprocess.run(stats).returncode
    if src != 0:
        print(f"hlmtune profile nsys: error: nsys stats exited with {src}", file=sys.stderr)
        return src
    sqlite_path = report.with_suffix(".sqlite")
    summary = summarize_path([sqlite_path] if sqlite_path.exists() else [out / "stats"])
    atomic_write_json(out / API_SUMMARY_FILE, summary)
    print(f"wrote {out / API_SUMMARY_FILE}")
    return rc
