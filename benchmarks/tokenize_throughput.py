"""Tokenizer throughput on the MIT-BIH Arrhythmia Database, side by side in one run.

Prints, for all records of ``--records`` (default ``$HLM_DATA/mitdb``, 48 records):

* read-only: seconds to only read every record and its annotations with ``wfdb``
  (``wfdb.rdrecord`` + ``wfdb.rdann`` with their defaults: the floor any wfdb-based tool
  pays), and the same for the reads the tokenizer itself does (digital int16 samples,
  annotations);
* tokenize with 1 worker and with 2 workers (read, validate, hash inputs, tokenize,
  write shards atomically, manifest), into a fresh directory each time;
* beats/s for each, CPU seconds (process + pool workers), the ratios, the targets, and
  the projection to the 50,067,387 beats
  of the HLM papers (which tokenized at about 1,300 beats/s).

The machine may be shared: each measurement is repeated ``--repeats`` times, interleaved,
and the best (min) and median are shown; ratios use the best times.

Usage: ``HLM_DATA=../shared/data python benchmarks/tokenize_throughput.py [--repeats 3]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

PAPER_BEATS = 50_067_387  # beats of the HLM papers' datasets
PAPER_RATE = 1_300.0  # beats/s of the papers' tokenizer (11 of 16 datasets in 11 hours)


def _cpu() -> float:
    """CPU seconds of this process and its finished children (pool workers)."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _read_only(records_dir: Path, names, tokenizer_reads: bool):
    import wfdb

    c = _cpu()
    t = time.perf_counter()
    for n in names:
        path = str(records_dir / n)
        if tokenizer_reads:
            wfdb.rdrecord(path, physical=False, return_res=16)
        else:
            wfdb.rdrecord(path)
        wfdb.rdann(path, "atr")
    return time.perf_counter() - t, _cpu() - c


def _tokenize(records_dir: Path, names, workers: int, params, scratch: Path):
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory

    out = scratch / f"out_w{workers}"
    shutil.rmtree(out, ignore_errors=True)
    c = _cpu()
    t = time.perf_counter()
    s = tokenize_directory(records_dir, out, params=params, options=RecordOptions(), records=names,
                           workers=workers, progress=False)
    dt, dc = time.perf_counter() - t, _cpu() - c
    if not s.ok:
        raise SystemExit(f"tokenize failed: {s.failed}")
    manifest = (out / "manifest.json").read_bytes()
    return (dt, dc), s.beats, manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=Path, default=None, help="WFDB directory (default: $HLM_DATA/mitdb)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions of each measurement (default: 3)")
    ap.add_argument("--scheme", default="samples", choices=("samples", "annotation"), help="default: samples")
    ap.add_argument("--window", type=int, default=128, help="default: 128")
    args = ap.parse_args()
    records_dir = args.records
    if records_dir is None:
        if not os.environ.get("HLM_DATA"):
            print("set HLM_DATA or pass --records", file=sys.stderr)
            return 2
        records_dir = Path(os.environ["HLM_DATA"]) / "mitdb"
    # Imports and page cache are warmed before timing (every variant then reads from memory).
    import numpy as np  # noqa: F401
    import scipy.signal  # noqa: F401
    import wfdb  # noqa: F401

    from hlmtune.ecg_tokenizer.records import list_records
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    names = list_records(records_dir)
    load_before = os.getloadavg()
    params = TokenizerParams(scheme=args.scheme, window=args.window)
    with tempfile.TemporaryDirectory(prefix="hlm_tok_bench_") as tmp:
        scratch = Path(tmp)
        _read_only(records_dir, names, False)
        _tokenize(records_dir, names[:2], 1, params, scratch)
        res = {"read": [], "read_tok": [], "w1": [], "w2": []}
        cpu = {k: [] for k in res}
        beats = None
        manifests = set()
        for _ in range(args.repeats):
            for k, tr in (("read", False), ("read_tok", True)):
                wall, c = _read_only(records_dir, names, tr)
                res[k].append(wall)
                cpu[k].append(c)
            for w in (1, 2):
                (dt, dc), b, m = _tokenize(records_dir, names, w, params, scratch)
                res[f"w{w}"].append(dt)
                cpu[f"w{w}"].append(dc)
                beats = b
                manifests.add(m)
    load_after = os.getloadavg()
    best = {k: min(v) for k, v in res.items()}
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"MIT-BIH: {len(names)} records, {beats:,} beats tokenized; scheme={params.scheme} window={params.window} "
          f"target_rate={params.target_rate:g} Hz; {args.repeats} repeats (best / median); cpus={os.cpu_count()}")
    print(f"machine load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} "
          f"(other processes share the {os.cpu_count()} CPUs; 2-worker numbers need 2 idle CPUs)")
    print(f"{'measurement':58s} {'best s':>8s} {'median s':>9s} {'beats/s':>10s} {'x read-only':>12s} {'cpu s':>7s}")
    rows = [
        ("read-only, wfdb defaults (rdrecord + rdann), 1 process", "read"),
        ("read-only, the tokenizer's wfdb calls (digital), 1 process", "read_tok"),
        ("tokenize, 1 worker (read+validate+hash+tokenize+write)", "w1"),
        ("tokenize, 2 workers", "w2"),
    ]
    for label, k in rows:
        print(f"{label:58s} {best[k]:8.2f} {med[k]:9.2f} {beats / best[k]:10,.0f} {best[k] / best['read']:12.2f} "
              f"{min(cpu[k]):7.2f}")
    r1 = best["w1"] / best["read"]
    r2 = best["w2"] / best["read"]
    print(f"ratio tokenize(1 worker) / read-only           = {r1:.2f}  (target <= 1.30: {'PASS' if r1 <= 1.3 else 'FAIL'})")
    print(f"ratio tokenize(2 workers) / read-only(1 proc)  = {r2:.2f}  (target < 1.00: {'PASS' if r2 < 1.0 else 'FAIL'})")
    print(f"speed-up 2 workers vs 1 worker                 = {best['w1'] / best['w2']:.2f}x")
    print(f"CPU seconds tokenize(1 worker) / read-only     = {min(cpu['w1']) / min(cpu['read']):.2f}  "
          f"(load-independent view of the first target)")
    print(f"outputs byte-identical across runs and worker counts: {'yes' if len(manifests) == 1 else 'NO'}")
    for k, label in (("w1", "1 worker"), ("w2", "2 workers")):
        rate = beats / best[k]
        print(f"projection to {PAPER_BEATS:,} beats, {label}: {PAPER_BEATS / rate / 60:.1f} min "
              f"(papers' tokenizer at ~{PAPER_RATE:,.0f} beats/s: {PAPER_BEATS / PAPER_RATE / 60:.0f} min; "
              f"{rate / PAPER_RATE:.0f}x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
