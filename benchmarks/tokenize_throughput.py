"""Tokenizer throughput on the MIT-BIH Arrhythmia Database, side by side in one run.

Prints, for all records of ``--records`` (default ``$HLM_DATA/mitdb``, 48 records):

* read-only, three ways: ``wfdb`` defaults (``wfdb.rdrecord`` physical float64 +
  ``wfdb.rdann``: what a wfdb-based tool pays); digital int16 samples + ``wfdb.rdann``; and the
  fastest read-only path, the reads the tokenizer itself does (digital int16 samples + the
  pack's own ``.atr`` reader, ``hlmtune.ecg_tokenizer.annotations.read_mit_annotations``);
* tokenize with 1 worker and with 2 workers (read, validate, hash inputs, tokenize,
  write shards atomically, manifest), into a fresh directory each time;
* beats/s for each, CPU seconds (process + pool workers), and the tokenize / read-only ratios
  against the wfdb-defaults baseline and the fastest read-only path side by side (against the
  first, "faster than reading" mostly measures the annotation-reader swap; against the second,
  what tokenizing adds to the reads it cannot avoid).

No rate of the papers' tokenizer is printed: the papers give 11 hours for the token
generation of 11 datasets, not a measured rate on comparable hardware.

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

PAPER_BEATS = 50_067_387  # beats of the HLM papers' datasets (a size, for the projection)
READ_MODES = ("wfdb", "digital_rdann", "digital_own")


def _cpu() -> float:
    """CPU seconds of this process and its finished children (pool workers)."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _read_only(records_dir: Path, names, mode: str):
    """Read every record's samples and annotations, nothing else.

    Args:
        records_dir (Path): WFDB directory.
        names: record names.
        mode (str): ``wfdb`` (physical samples + ``wfdb.rdann``), ``digital_rdann`` (digital
            int16 samples + ``wfdb.rdann``), ``digital_own`` (digital int16 samples + the pack's
            ``.atr`` reader, falling back to ``wfdb.rdann`` where the tokenizer does).
    """
    import wfdb

    from hlmtune.ecg_tokenizer.annotations import read_mit_annotations

    c = _cpu()
    t = time.perf_counter()
    for n in names:
        path = str(records_dir / n)
        if mode == "wfdb":
            wfdb.rdrecord(path)
        else:
            wfdb.rdrecord(path, physical=False, return_res=16)
        if mode != "digital_own" or read_mit_annotations(path + ".atr") is None:
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
        _read_only(records_dir, names, "wfdb")
        _tokenize(records_dir, names[:2], 1, params, scratch)
        res = {**{m: [] for m in READ_MODES}, "w1": [], "w2": []}
        cpu = {k: [] for k in res}
        beats = None
        manifests = set()
        for _ in range(args.repeats):
            for k in READ_MODES:
                wall, c = _read_only(records_dir, names, k)
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
    print(f"{'measurement':62s} {'best s':>8s} {'median s':>9s} {'beats/s':>10s} {'x wfdb read':>12s} "
          f"{'x fastest read':>15s} {'cpu s':>7s}")
    rows = [
        ("read-only, wfdb defaults (physical rdrecord + rdann)", "wfdb"),
        ("read-only, digital rdrecord + rdann", "digital_rdann"),
        ("read-only, fastest: digital rdrecord + the pack's .atr reader", "digital_own"),
        ("tokenize, 1 worker (read+validate+hash+tokenize+write)", "w1"),
        ("tokenize, 2 workers", "w2"),
    ]
    for label, k in rows:
        print(f"{label:62s} {best[k]:8.2f} {med[k]:9.2f} {beats / best[k]:10,.0f} {best[k] / best['wfdb']:12.2f} "
              f"{best[k] / best['digital_own']:15.2f} {min(cpu[k]):7.2f}")
    for k, label in (("w1", "1 worker "), ("w2", "2 workers")):
        spread = (min(res[k]) / max(res["digital_own"]), max(res[k]) / min(res["digital_own"]))
        print(f"tokenize({label}) / read-only: vs wfdb defaults {best[k] / best['wfdb']:.2f}, "
              f"vs fastest read {best[k] / best['digital_own']:.2f} "
              f"(range over repeats {spread[0]:.2f}-{spread[1]:.2f})")
    r1, r2 = best["w1"] / best["wfdb"], best["w2"] / best["wfdb"]
    print(f"targets (vs wfdb defaults): 1 worker <= 1.30: {'PASS' if r1 <= 1.3 else 'FAIL'}; "
          f"2 workers < 1.00: {'PASS' if r2 < 1.0 else 'FAIL'}")
    print(f"speed-up 2 workers vs 1 worker = {best['w1'] / best['w2']:.2f}x")
    print(f"CPU seconds tokenize(1 worker) / fastest read = {min(cpu['w1']) / min(cpu['digital_own']):.2f} "
          f"(load-independent view)")
    print(f"outputs byte-identical across runs and worker counts: {'yes' if len(manifests) == 1 else 'NO'}")
    for k, label in (("w1", "1 worker"), ("w2", "2 workers")):
        rate = beats / best[k]
        print(f"projection to {PAPER_BEATS:,} beats at this rate, {label}: {PAPER_BEATS / rate / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
