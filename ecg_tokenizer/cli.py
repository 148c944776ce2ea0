"""``hlmtune tokenize``, ``hlmtune download``, ``hlmtune synth-ecg``.

Registration imports only argparse: numpy, scipy and wfdb are imported inside the
command functions so ``hlmtune --help`` stays fast. Exit codes: 0 success, 1 some records
failed (or the download failed), 2 bad arguments or no input.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

from hlmtune.helpformat import DefaultsHelpFormatter

_EPILOG_TOKENIZE = """\
examples:
  hlmtune tokenize --records $HLM_DATA/mitdb --scheme samples --beat-samples 128 --out tokens/mitdb
  hlmtune tokenize --records $HLM_DATA/mitdb $HLM_DATA/svdb --out tokens/mitdb_svdb   # 360 Hz and 128 Hz, one set
  hlmtune tokenize --records svdb=/data/mit-bih-supraventricular --out tokens/mitdb_svdb  # adds svdb to that set
  hlmtune tokenize --records $HLM_DATA/mitdb --scheme annotation --rr-bins 16 --out tokens/beats
  hlmtune synth-ecg --out synth && hlmtune tokenize --records synth --scheme samples --out tokens/synth

Output: OUT/manifest.json plus OUT/records/<database>__<record>.{tokens.npy,beats.npy,json}.
Every record is resampled to --target-rate. A rerun with the same parameters skips finished
records; records of other databases already in OUT stay. Exit status 1 lists failed records."""

# TokenizerParams field -> the ``hlmtune tokenize`` flag that sets it, so that the
# parameters' ValueErrors (worded for Python callers) name what the user typed.
_PARAM_FLAGS = {
    "scheme": "--scheme", "window": "--beat-samples", "target_rate": "--target-rate", "label_mode": "--label-mode",
    "quantization": "--quantization", "levels": "--levels", "amplitude_mv": "--amplitude-mv", "mu": "--mu",
    "rr_bins": "--rr-bins", "rr_min_s": "--rr-min", "rr_max_s": "--rr-max",
}
_PARAM_NAME = re.compile(r"(?<![\w-])(" + "|".join(sorted(_PARAM_FLAGS, key=len, reverse=True)) + r")(?![\w-])")

# Lowest ``synth-ecg --fs``: wfdb's gqrs detector (``tokenize --no-annotations`` /
# ``--detector-check``) fails below ~57 Hz (its QRS step 0.07 s / 4 must be >= 1 sample),
# and at 60 Hz a QRS (~0.1 s) still spans 6 samples; the tokenizer then resamples to
# ``--target-rate`` (default 128 Hz). 0 or negative rates crash wfdb.
SYNTH_MIN_FS = 60


class _Defaults(DefaultsHelpFormatter):
    """The pack's defaults-in-help formatter, with a wider option column."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)


class _Combined(_Defaults, argparse.RawDescriptionHelpFormatter):
    """Defaults in help and a verbatim epilog."""


# The PhysioNet databases `hlmtune download` offers (wfdb.dl_database names them so).
DOWNLOADS = {
    "mitdb": "MIT-BIH Arrhythmia Database, ~100 MB",
    "svdb": "MIT-BIH Supraventricular Arrhythmia Database, 128 Hz, ~55 MB",
    "incartdb": "St Petersburg INCART 12-lead Arrhythmia Database, 75 records of 30 min, 257 Hz, ~800 MB, patients "
                "no config trains on: `hlmtune eval --config JOB --test-records DIR` scores them, read from lead II",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ECG subcommands to the ``hlmtune`` parser.

    Args:
        subparsers (argparse._SubParsersAction): from ``parser.add_subparsers()``.
    """
    p = subparsers.add_parser(
        "tokenize",
        help="tokenize WFDB ECG records into heartbeat token shards",
        description="Tokenize a directory of WFDB records (with or without beat annotations) into "
        "memory-mapped token shards and a manifest, in parallel over records.",
        epilog=_EPILOG_TOKENIZE,
        formatter_class=_Combined,
    )
    g = p.add_argument_group("input / output")
    g.add_argument("--verify", metavar="DIR", default=None,
                   help="check the shards in DIR against their manifest (sizes and every SHA-256) and exit: 0 all match, "
                        "1 some differ (named); no tokenizing")
    g.add_argument("--records", nargs="+", metavar="[NAME=]DIR",
                   help="WFDB database folder(s) (records from each RECORDS file, else every *.hea), tokenized into one "
                        "shard set; record ids carry the database, NAME or the folder's name (mitdb/100, svdb/800)")
    g.add_argument("--out", metavar="DIR", help="output directory for shards and manifest.json")
    g.add_argument("--records-list", metavar="FILE", default=None, help="file with one record name per line to tokenize instead of all records (one --records folder only)")
    g.add_argument("--workers", type=int, default=None, metavar="N", help="worker processes (default: the CPUs available; 1 = no pool)")
    g.add_argument("--sampto", type=int, default=None, metavar="N", help="read only the first N samples of each record (quick runs)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--implementation", choices=("fast", "reference"), default="fast", help="vectorised path or the slow per-beat reference (identical tokens)")
    g = p.add_argument_group("scheme")
    g.add_argument("--scheme", choices=("annotation", "samples"), default="samples", help="annotation: one token per beat from its label [x RR bin]; samples: a window of quantized samples per beat")
    g.add_argument("--beat-samples", "--window", dest="window", type=int, default=128, metavar="N",
                   help="samples per beat at the target rate (128..1024; scheme samples). Not the model's context "
                        "window: that is the data builder's max_seq_len (`--window` is the old name)")
    g.add_argument("--target-rate", type=float, default=128.0, metavar="HZ", help="canonical sampling rate every record is resampled to")
    g.add_argument("--label-mode", choices=("aami", "raw"), default="aami", help="beat label classes: AAMI N/S/V/F/Q or raw WFDB symbols")
    g.add_argument("--quantization", choices=("mu-law", "uniform"), default="mu-law", help="amplitude quantizer")
    g.add_argument("--levels", type=int, default=256, metavar="N", help="quantization levels")
    g.add_argument("--amplitude-mv", type=float, default=3.0, metavar="MV", help="quantizer range +-MV after baseline removal (beyond: clipped)")
    g.add_argument("--mu", type=float, default=255.0, help="mu-law compression constant")
    g.add_argument("--rr-bins", type=int, default=16, metavar="N", help="RR-interval bins (0 = no RR information)")
    g.add_argument("--rr-min", type=float, default=0.2, metavar="S", help="lower edge of the first RR bin (seconds)")
    g.add_argument("--rr-max", type=float, default=2.0, metavar="S", help="upper edge of the last RR bin (seconds)")
    g = p.add_argument_group("beats and leads")
    g.add_argument("--lead", default="MLII", help="lead name, or signal index (e.g. 0)")
    g.add_argument("--lead-fallback", choices=("first", "error"), default="first", help="when the lead is absent: use it under another name (MLII: ML2 or II, any case), else signal 0 (noted in the manifest), or fail the record")
    g.add_argument("--second-lead", action="store_true", help="also write each beat's window of the second lead (the first other signal: MIT-BIH's V1, svdb's ECG2) as records/<id>.lead2.npy, for the beat prompt's dataset.second_lead; a record of one signal fails (scheme samples)")
    g.add_argument("--annotation-ext", default="atr", metavar="EXT", help="reference beat annotation file extension")
    g.add_argument("--no-annotations", action="store_true", help="ignore annotation files for beat positions: run the R-peak detector (Se/+P vs the annotations is reported when they exist)")
    g.add_argument("--detector", choices=("gqrs", "xqrs"), default="gqrs", help="R-peak detector from wfdb.processing")
    g.add_argument("--detector-check", action="store_true", help="also run the detector on annotated records and report Se/+P (150 ms window)")
    g.add_argument("--on-missing-annotations", choices=("detect", "error"), default="detect", help="record without annotation file: use the detector or fail the record")
    g.add_argument("--on-unknown-symbols", choices=("error", "drop"), default="error", help="annotation symbols that are not WFDB codes: fail the record or drop them")
    p.set_defaults(func=cmd_tokenize)

    p = subparsers.add_parser(
        "download",
        help="download a PhysioNet database (needs internet)",
        description="Download a PhysioNet database with wfdb.dl_database. Needs internet access; "
        "offline it fails with a clear error and exit status 1.",
        formatter_class=_Defaults,
    )
    p.add_argument("database", choices=tuple(DOWNLOADS), help="database to download (" + "; ".join(
        f"{k}: {v}" for k, v in DOWNLOADS.items()) + ")")
    p.add_argument("--out", required=True, metavar="DIR", help="destination directory")
    p.add_argument("--record", action="append", default=None, metavar="NAME", help="download only this record (repeatable; default: all)")
    p.set_defaults(func=cmd_download)

    p = subparsers.add_parser(
        "synth-ecg",
        help="write synthetic labeled ECG records (WFDB) for offline runs",
        description="Write synthetic WFDB records (2 leads, format 212) with beat annotations "
        "(N, V, A) and atrial fibrillation episodes (rhythm annotations) for offline runs.",
        formatter_class=_Defaults,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="destination directory")
    p.add_argument("--n-records", type=int, default=4, metavar="N", help="records to write (>= 1; every other one has an AF episode)")
    p.add_argument("--duration", type=float, default=120.0, metavar="S", help="length of each record in seconds (>= 5)")
    p.add_argument("--fs", type=int, default=360, metavar="HZ", help=f"sampling rate (>= {SYNTH_MIN_FS})")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same files)")
    p.set_defaults(func=cmd_synth)


def _flag_names(message: str) -> str:
    """Rewrite TokenizerParams field names in an error message as ``hlmtune tokenize`` flags.

    Args:
        message (str): e.g. ``"window must be 128..1024 samples, got 64"``.

    Returns:
        str: e.g. ``"--beat-samples must be 128..1024 samples, got 64"``.
    """
    return _PARAM_NAME.sub(lambda m: _PARAM_FLAGS[m.group(1)], message)


def record_folder(arg: str) -> "tuple[str, Path]":
    """``NAME=DIR`` or ``DIR`` of ``--records`` as (database name, folder).

    Args:
        arg (str): the command-line item.

    Returns:
        tuple[str, Path]: the name (default: the folder's own name) and the folder.

    Raises:
        ValueError: an empty or path-like name.
    """
    from hlmtune.ecg_tokenizer.pipeline import database_name

    name, sep, folder = arg.partition("=")
    if not sep or os.path.exists(arg):
        return database_name(Path(arg)), Path(arg)
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name):
        raise ValueError(f"--records {arg}: the database name {name!r} must be letters, digits, '_', '-' or '.'")
    return name, Path(folder)


def cmd_tokenize(args: argparse.Namespace) -> int:
    """Run ``hlmtune tokenize``.

    Args:
        args (argparse.Namespace): parsed arguments.

    Returns:
        int: 0 all records done, 1 some failed, 2 bad arguments / no input.
    """
    from hlmtune.files import ensure_dir
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, RecordSource, default_workers, tokenize_sources
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    if args.verify is not None:
        return _verify(args.verify)
    missing = [f for f, v in (("--records", args.records), ("--out", args.out)) if not v]
    if missing:
        print(f"hlmtune tokenize: error: the following arguments are required: {', '.join(missing)} "
              "(or --verify DIR)", file=sys.stderr)
        return 2
    try:
        try:
            params = TokenizerParams(
                scheme=args.scheme, window=args.window, target_rate=args.target_rate, label_mode=args.label_mode,
                quantization=args.quantization, levels=args.levels, amplitude_mv=args.amplitude_mv, mu=args.mu,
                rr_bins=args.rr_bins, rr_min_s=args.rr_min, rr_max_s=args.rr_max,
            )
        except ValueError as e:
            raise ValueError(_flag_names(str(e))) from None
        options = RecordOptions(
            lead=args.lead, lead_fallback=args.lead_fallback, use_annotations=not args.no_annotations,
            annotation_ext=args.annotation_ext, on_missing_annotations=args.on_missing_annotations,
            on_unknown_symbols=args.on_unknown_symbols, detector_check=args.detector_check,
            detector=args.detector, sampto=args.sampto, second_lead=args.second_lead,
        )
        records = None
        if args.records_list:
            if len(args.records) > 1:
                raise ValueError("--records-list names records of one folder: give one --records folder with it")
            lst = Path(args.records_list)
            if not lst.exists():
                raise FileNotFoundError(f"--records-list {lst} does not exist")
            records = [ln.strip() for ln in lst.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        sources = [RecordSource(d, name, records) for name, d in (record_folder(x) for x in args.records)]
        out = ensure_dir(args.out, "--out")
        summary = tokenize_sources(
            sources, out, params=params, options=options, workers=args.workers or default_workers(),
            progress=not args.no_progress, implementation=args.implementation,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"hlmtune tokenize: error: {e}", file=sys.stderr)
        return 2
    print(summary.format())
    return 0 if summary.ok else 1


def _verify(folder: str) -> int:
    """``hlmtune tokenize --verify DIR``: 0 every shard matches its manifest, 1 some differ, 2 unreadable."""
    from hlmtune.ecg_tokenizer.shards import ShardError, verify_shards

    try:
        bad = verify_shards(Path(folder))
    except ShardError as e:
        print(f"hlmtune tokenize --verify: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as e:
        print(f"hlmtune tokenize --verify: error: {e}", file=sys.stderr)
        return 2
    for line in bad:
        print(line, file=sys.stderr)
    print(f"{folder}: {'every shard matches its manifest' if not bad else f'{len(bad)} file(s) differ'}")
    return 1 if bad else 0


def cmd_download(args: argparse.Namespace) -> int:
    """Run ``hlmtune download``: ``wfdb.dl_database`` with a clear offline error.

    Args:
        args (argparse.Namespace): parsed arguments.

    Returns:
        int: 0 downloaded, 1 failed (network or server).
    """
    import wfdb

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        wfdb.dl_database(args.database, str(out), records=args.record or "all")
    except OSError as e:  # requests' ConnectionError/Timeout/HTTPError are OSErrors
        print(
            f"hlmtune download {args.database}: cannot download from PhysioNet into {out}: this command needs "
            f"internet access to physionet.org ({type(e).__name__}: {str(e)[:300]}). Offline, copy the database "
            f"from a machine that has it and pass its directory to `hlmtune tokenize --records`.",
            file=sys.stderr,
        )
        return 1
    except Exception as e:  # wfdb raises ValueError etc. for unknown databases/records
        print(f"hlmtune download {args.database}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"downloaded {args.database} into {out}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    """Run ``hlmtune synth-ecg``.

    Args:
        args (argparse.Namespace): parsed arguments.

    Returns:
        int: 0 written, 2 bad arguments (out-of-range flag, --out not a directory).
    """
    from hlmtune.files import OutputPathError, ensure_dir
    from hlmtune.ecg_tokenizer.synth import write_synthetic_database

    for flag, ok, allowed, value in (
        ("--n-records", args.n_records >= 1, "an integer >= 1", args.n_records),
        ("--duration", args.duration >= 5 and math.isfinite(args.duration), "a finite number >= 5 (seconds)", args.duration),
        ("--fs", args.fs >= SYNTH_MIN_FS, f"an integer >= {SYNTH_MIN_FS} (Hz)", args.fs),
    ):
        if not ok:
            print(f"hlmtune synth-ecg: error: {flag} must be {allowed}, got {value}", file=sys.stderr)
            return 2
    try:
        ensure_dir(args.out, "--out")
    except OutputPathError as e:
        print(f"hlmtune synth-ecg: error: {e}", file=sys.stderr)
        return 2
    names = write_synthetic_database(Path(args.out), n_records=args.n_records, fs=args.fs, duration_s=args.duration, seed=args.seed)
    print(f"wrote {len(names)} synthetic records to {os.fspath(args.out)}: {' '.join(names)}")
    return 0
