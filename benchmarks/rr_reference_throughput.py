"""The beat prompt's RR computations on the training patients' beats, side by side in one run.

Every example the HLM trains on or classifies shows RR tokens relative to a running reference
of the patient's own intervals (``dataset.normalized_rr`` beats of ``dataset.rr_reference``),
and optionally the published RR features (``local_rr``, ``average_rr_s``, ``long_rr``).
``hlmtune.data_builders.ecg`` computes them once per record when a dataset is built (every
fold and seed of ``hlmtune cv`` builds its own). This times each one over the same beat tables:

* ``median`` / ``mean`` of the last 256 intervals (vectorised sliding windows);
* ``gated`` / ``gated_regular`` of the last 32 accepted intervals (a beat-by-beat Python loop:
  the gate depends on the reference so far, so it cannot be a sliding window);
* ``long_rr`` (upper quartile of 256), ``local_rr`` (10 beats), ``average_rr_s`` (300 s);

as seconds for all beats (best and median of ``--repeats``, interleaved), beats/s, and the
ratio to the 256-beat median (the reference the configs shipped before the gated ones were
judged). The row of the reference ``--config`` names (default ``configs/ecg_lora.yaml``) is marked.

Beat tables come from the records' reference annotations (``load_record``, the tokenizer's
reader: beats kept as the tokenizer keeps them), ``rr`` in each record's own samples, so a
128 Hz svdb record and a 360 Hz MIT-BIH record are timed as the prompt builder sees them.
The records: MIT-BIH DS1 in ``$HLM_DATA/mitdb`` and every record of ``$HLM_DATA/svdb`` (the 61
training patients), or the folders given with ``--records`` (every record of each).

Usage: ``HLM_DATA=../shared/data python benchmarks/rr_reference_throughput.py [--repeats 5]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TABLE_DTYPE = np.dtype([("sample", np.int64), ("rr", np.int64)])  # the fields the RR code reads


def _tables(folders: Sequence[Tuple[Path, Sequence[str]]]) -> List[Tuple[np.ndarray, float]]:
    """(beat table, fs) of each record: ``rr`` = samples since the previous beat, -1 for the first."""
    from hlmtune.ecg_tokenizer.core import rr_info
    from hlmtune.ecg_tokenizer.records import load_record
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    params, out = TokenizerParams(), []
    for folder, names in folders:
        for name in names:
            rec = load_record(folder, name, hash_inputs=False)
            table = np.zeros(rec.beat_samples.size, TABLE_DTYPE)
            table["sample"] = rec.beat_samples
            table["rr"] = rr_info(rec, params)[0]  # the tokenizer's intervals (its beat table's ``rr``)
            out.append((table, float(rec.fs)))
    return out


def computations() -> Dict[str, Callable[[np.ndarray, float], np.ndarray]]:
    """Name -> the RR computation the prompt builder runs for one record (table, fs)."""
    from hlmtune.data_builders import rr_features as rr

    return {
        "median of 256": lambda t, fs: rr.running_reference(t, 256, "median"),
        "mean of 256": lambda t, fs: rr.running_reference(t, 256, "mean"),
        "gated of 32": lambda t, fs: rr.running_reference(t, 32, "gated"),
        "gated_regular of 32": lambda t, fs: rr.running_reference(t, 32, "gated_regular"),
        "long_rr (upper quartile of 256)": lambda t, fs: rr.long_reference(t, 256),
        "local_rr (10 beats)": lambda t, fs: rr.local_average_rr(t, 10),
        "average_rr_s (300 s)": lambda t, fs: rr.window_average_rr(t, 300.0, fs),
    }


def shipped_row(config: Path) -> str:
    """The row of the reference a config's ``dataset`` keys name (``rr_reference`` of ``normalized_rr``)."""
    import yaml

    ds = yaml.safe_load(Path(config).read_text()).get("dataset") or {}
    return f"{ds.get('rr_reference', 'median')} of {ds.get('normalized_rr')}"


def measure(tables, repeats: int) -> Dict[str, List[float]]:
    """Seconds of each computation over every table, ``repeats`` times, interleaved."""
    funcs = computations()
    times: Dict[str, List[float]] = {k: [] for k in funcs}
    for _ in range(repeats):
        for name, f in funcs.items():
            t0 = time.perf_counter()
            for table, fs in tables:
                f(table, fs)
            times[name].append(time.perf_counter() - t0)
    return times


def _folders(args: argparse.Namespace) -> List[Tuple[Path, List[str]]]:
    from hlmtune.ecg_tokenizer.records import list_records
    from training_patients import training_folders

    if args.records:
        return [(Path(d), list_records(Path(d))) for d in args.records]
    return [(folder, names) for folder, _, names in training_folders()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", nargs="+", default=None, metavar="DIR",
                    help="WFDB folders, every record of each (default: DS1 of $HLM_DATA/mitdb + $HLM_DATA/svdb)")
    ap.add_argument("--repeats", type=int, default=5, help="repetitions of each measurement (default: 5)")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "ecg_lora.yaml",
                    help="the config whose reference is marked (default: configs/ecg_lora.yaml)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: at least 1")
    folders = _folders(args)
    tables = _tables(folders)
    beats = sum(t.size for t, _ in tables)
    measure(tables[:2], 1)  # imports and first-call costs out of the timed runs
    load = os.getloadavg()[0]
    times = measure(tables, args.repeats)
    best = {k: min(v) for k, v in times.items()}
    shipped = shipped_row(args.config)
    where = ", ".join(f"{d} ({len(n)} records)" for d, n in folders)
    print(f"{len(tables)} records, {beats:,} beats: {where}; {args.repeats} repeats (best / median), "
          f"load average before {load:.2f}, cpus={os.cpu_count()}; one thread (numpy and Python)")
    print(f"{'computation':34s} {'best s':>8s} {'median s':>9s} {'beats/s':>12s} {'x median of 256':>16s}")
    for name, v in times.items():
        mark = f"  <- {args.config.name}" if name == shipped else ""
        print(f"{name:34s} {best[name]:8.3f} {statistics.median(v):9.3f} {beats / best[name]:12,.0f} "
              f"{best[name] / best['median of 256']:16.2f}{mark}")
    if shipped not in times:
        print(f"{args.config} ships {shipped}: not one of the rows above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
