"""Read and validate one WFDB record: one lead, beat positions, labels and rhythms.

Everything the tokenizers need comes out of :func:`load_record` as an :class:`EcgRecord`
(digital samples of one lead, beat positions, beat symbols, per-beat rhythm). Every
problem is a :class:`RecordError` naming the record and the problem, so a directory run can
report it and carry on with the other records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from hlmtune.ecg_tokenizer.annotations import read_mit_annotations
from hlmtune.ecg_tokenizer.labels import BEAT_SYMBOLS, NON_BEAT_SYMBOLS, rhythm_name

ON_MISSING_ANNOTATIONS = ("detect", "error")
ON_UNKNOWN_SYMBOLS = ("error", "drop")
LEAD_FALLBACKS = ("first", "error")
_SYMBOL_CODE = {s: i for i, s in enumerate(BEAT_SYMBOLS)}
_CODES = {**{s: -1 for s in NON_BEAT_SYMBOLS}, "+": -3, **_SYMBOL_CODE}
_FMT_16 = frozenset({"8", "16", "61", "80", "160", "212", "310", "311"})
# Units WFDB headers use for ECG, as a factor to millivolts.
_UNIT_TO_MV = {"mv": 1.0, "uv": 1e-3, "µv": 1e-3, "v": 1e3, "nu": 1.0, "": 1.0}


class RecordError(Exception):
    """A record that cannot be tokenized.

    Args:
        record (str): record name.
        problem (str): what is wrong (names the file or the value).
    """

    def __init__(self, record: str, problem: str) -> None:
        super().__init__(f"record {record}: {problem}")
        self.record = record
        self.problem = problem

    def __reduce__(self):  # picklable across the process pool
        return (RecordError, (self.record, self.problem))


@dataclass
class EcgRecord:
    """One lead of a record with its beats.

    Attributes:
        name (str): record name relative to the records directory (e.g. ``"100"``).
        fs (float): sampling rate (Hz).
        lead (str): lead name used.
        signal (np.ndarray): (n_samples,) integer (int16 or int64) digital samples of that lead.
        gain_per_mv (float): digital units per millivolt.
        beat_samples (np.ndarray): (n_beats,) int64 R-peak sample indices, increasing.
        beat_symbols (np.ndarray): (n_beats,) int16 index into ``BEAT_SYMBOLS``; -1 unlabeled.
        beat_rhythms (np.ndarray): (n_beats,) int16 index into ``rhythms``; -1 unknown.
        rhythms (List[str]): rhythm labels in order of first appearance.
        beat_source (str): ``"annotations"`` or ``"detector"``.
        annotated_beats (int): beat annotations in the annotation file (0 when none).
        detector (Optional[Dict]): detector vs annotation statistics, when both exist.
        inputs (Dict[str, str]): input file name -> sha256.
        notes (List[str]): non-fatal remarks (e.g. lead fallback).
        dropped (List[Dict[str, Any]]): beat annotations left out before tokenizing
            (``{"sample", "reason"}``: outside the signal); the tokenizer adds them to its own.
        n_samples (int): samples in the lead (from ``signal`` when not given).
        signal2 (Optional[np.ndarray]): (n_samples,) digital samples of the second lead (the
            first signal that is not ``lead``), read with ``second_lead``; None otherwise.
        lead2 (Optional[str]): its name.
        gain2_per_mv (float): its digital units per millivolt.
    """

    name: str
    fs: float
    lead: str
    signal: np.ndarray
    gain_per_mv: float
    beat_samples: np.ndarray
    beat_symbols: np.ndarray
    beat_rhythms: np.ndarray
    rhythms: List[str]
    beat_source: str
    annotated_beats: int
    detector: Optional[Dict[str, float]] = None
    inputs: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    n_samples: int = -1
    dropped: List[Dict[str, Any]] = field(default_factory=list)
    signal2: Optional[np.ndarray] = None
    lead2: Optional[str] = None
    gain2_per_mv: float = float("nan")

    def __post_init__(self) -> None:
        if self.n_samples < 0:
            self.n_samples = int(self.signal.shape[0])

    def without_signal(self) -> "EcgRecord":
        """A copy without the samples (cheap to send between processes for writing)."""
        return dataclasses.replace(self, signal=self.signal[:0], n_samples=self.n_samples,
                                   signal2=None if self.signal2 is None else self.signal2[:0])


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def list_records(records_dir: Path) -> List[str]:
    """Record names in a directory: its ``RECORDS`` file, else every ``*.hea`` (recursive).

    Args:
        records_dir (Path): database directory.

    Returns:
        List[str]: names relative to ``records_dir`` without extension, sorted.

    Raises:
        FileNotFoundError: no such directory or no records in it.
    """
    records_dir = Path(records_dir)
    if not records_dir.is_dir():
        raise FileNotFoundError(f"records directory {records_dir} does not exist")
    listing = records_dir / "RECORDS"
    if listing.exists():
        names = [ln.strip() for ln in listing.read_text().splitlines() if ln.strip()]
    else:
        names = [p.relative_to(records_dir).with_suffix("").as_posix() for p in records_dir.rglob("*.hea")]
    if not names:
        raise FileNotFoundError(f"no WFDB records (*.hea or RECORDS) in {records_dir}")
    return sorted(set(names))


def _expected_bytes(fmt: str, n_values: int, byte_offset: int) -> Optional[int]:
    """Signal file size a header implies, or None when the format is not fixed-width."""
    from wfdb.io._signal import BYTES_PER_SAMPLE

    bps = BYTES_PER_SAMPLE.get(str(fmt))
    if not bps or str(fmt) in ("310", "311"):
        return None
    return int(byte_offset or 0) + int(math.ceil(n_values * bps))


def _check_signal_files(name: str, base: Path, header) -> List[Path]:
    """Check every signal file exists and has the size the header implies."""
    files: Dict[str, List[int]] = {}
    for i, fn in enumerate(header.file_name or []):
        files.setdefault(fn, []).append(i)
    paths = []
    for fn, chans in files.items():
        path = base.parent / fn
        paths.append(path)
        if not path.exists():
            raise RecordError(name, f"signal file {fn} is missing ({path})")
        if header.sig_len is None:
            continue
        i0 = chans[0]
        fmt = header.fmt[i0]
        offset = (header.byte_offset or [0] * header.n_sig)[i0] or 0
        want = _expected_bytes(fmt, header.sig_len * len(chans), offset)
        have = path.stat().st_size
        if want is None or have == want:
            continue
        what = (
            f"{header.sig_len} samples x {len(chans)} signals, format {fmt}"
            + (f", byte offset {offset}" if offset else "")
        )
        if have < want:
            raise RecordError(name, f"signal file {fn} is truncated: {have} bytes, header implies {want} ({what})")
        raise RecordError(
            name, f"header disagrees with signal file {fn}: file has {have} bytes, header implies {want} ({what})"
        )
    return paths


def _read_header(name: str, base: Path, hea: Path):
    """``wfdb.rdheader`` with a RecordError naming the header on failure."""
    import wfdb

    try:
        return wfdb.rdheader(str(base))
    except Exception as e:  # wfdb raises many types for bad headers
        raise RecordError(name, f"header {hea.name} is unreadable: {type(e).__name__}: {e}") from None


def _formats_fit_int16(hea: Path) -> bool:
    """True when every signal format in the header has at most 16 bits (a read hint only:
    anything unexpected returns False and the samples come back as int64)."""
    try:
        lines = [ln for ln in hea.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        n_sig = int(lines[0].split()[1])
        fmts = [re.match(r"\d+", ln.split()[1]).group() for ln in lines[1 : 1 + n_sig]]
        return len(fmts) == n_sig > 0 and all(f in _FMT_16 for f in fmts)
    except Exception:
        return False


# Other names of the same lead, tried (in order) before signal 0 when lead_fallback is "first".
# MLII is limb lead II with its electrodes moved onto the torso (the Holter placement of MIT-BIH);
# 12-lead databases name the standard limb lead "II" (St Petersburg INCART: I, II, III, AVR, ...),
# and some Holter databases spell the modified lead "ML2". The morphology the models learned from
# MLII is closest in lead II; signal 0 of a 12-lead record is lead I.
LEAD_OTHER_NAMES: Dict[str, Tuple[str, ...]] = {"MLII": ("ML2", "II")}


def _pick_lead(name: str, sig_names: List[str], lead: str, lead_fallback: str, notes: List[str]) -> int:
    """Index of the requested lead (name, or an integer index given as a string); with
    ``lead_fallback="first"`` an absent lead is looked for under its other names
    (:data:`LEAD_OTHER_NAMES`, any case), then signal 0 is taken (noted either way)."""
    if lead.isdigit():
        idx = int(lead)
        if idx >= len(sig_names):
            raise RecordError(name, f"lead index {idx} out of range: record has {len(sig_names)} signals {sig_names}")
        return idx
    if lead in sig_names:
        return sig_names.index(lead)
    if lead_fallback == "first":
        upper = [s.strip().upper() for s in sig_names]
        for other in (lead, *LEAD_OTHER_NAMES.get(lead, ())):
            if other.upper() in upper:
                idx = upper.index(other.upper())
                notes.append(f"lead {lead} absent, used {sig_names[idx]} (the same lead by another name; "
                             f"signals: {sig_names})")
                return idx
        notes.append(f"lead {lead} absent, used {sig_names[0]} (signals: {sig_names})")
        return 0
    raise RecordError(name, f"lead {lead} not in the record (signals: {sig_names})")


def load_record(
    records_dir: Path,
    name: str,
    *,
    lead: str = "MLII",
    lead_fallback: str = "first",
    use_annotations: bool = True,
    annotation_ext: str = "atr",
    on_missing_annotations: str = "detect",
    on_unknown_symbols: str = "error",
    detector_check: bool = False,
    detector: str = "gqrs",
    sampto: Optional[int] = None,
    hash_inputs: bool = True,
    second_lead: bool = False,
) -> EcgRecord:
    """Read one lead and the beats of a record, validating everything on the way.

    Args:
        records_dir (Path): database directory.
        name (str): record name relative to it.
        lead (str): lead name (default ``MLII``) or signal index as a string (``"0"``).
        lead_fallback (str): ``"first"`` uses signal 0 when the lead is absent (noted in
            the record's notes; MIT-BIH 102 and 104 have no MLII), ``"error"`` fails.
        use_annotations (bool): take beats from the annotation file; False runs the
            detector (and compares it with the annotations when they exist).
        annotation_ext (str): annotation file extension.
        on_missing_annotations (str): ``"detect"`` (R-peak detector) or ``"error"``.
        on_unknown_symbols (str): ``"error"`` or ``"drop"`` annotations whose symbol is not
            a WFDB code.
        detector_check (bool): also run the detector on annotated records and report its
            sensitivity / positive predictivity against the annotations.
        detector (str): R-peak detector, ``"gqrs"`` or ``"xqrs"`` (wfdb.processing).
        sampto (Optional[int]): read only samples [0, sampto) (quick runs, tests).
        hash_inputs (bool): compute sha256 of the input files.
        second_lead (bool): also read the second lead, the first signal other than the one
            ``lead`` / ``lead_fallback`` chose (MIT-BIH: V1 in most records; svdb: ``ECG2``),
            checked like the first; a record of one signal is an error.

    Returns:
        EcgRecord: the record.

    Raises:
        RecordError: any problem, naming the record.
    """
    if on_missing_annotations not in ON_MISSING_ANNOTATIONS:
        raise ValueError(f"on_missing_annotations must be one of {ON_MISSING_ANNOTATIONS}")
    if on_unknown_symbols not in ON_UNKNOWN_SYMBOLS:
        raise ValueError(f"on_unknown_symbols must be one of {ON_UNKNOWN_SYMBOLS}")
    base = Path(records_dir) / name
    hea = _header_file(name, base)
    full = sampto is None
    rec, header, fs, sig_files = _read_signal(name, base, hea, sampto)
    notes: List[str] = []
    sig, lead_name, gain_per_mv = _lead_signal(name, rec, header, lead, lead_fallback, full, notes)
    n = int(sig.size)
    sig2, lead2, gain2 = (_lead_signal(name, rec, header, str(_other_lead(name, header, lead, lead_fallback)),
                                       "error", full, []) if second_lead else (None, None, float("nan")))
    inputs = {p.name: sha256_file(p) for p in [hea, *sig_files]} if hash_inputs else {}

    atr = base.with_name(f"{base.name}.{annotation_ext}")
    ann: Optional[_Annotations] = None
    if atr.exists():
        ann = _read_annotations(name, base, atr, annotation_ext, None if full else n, n, on_unknown_symbols)
        if hash_inputs:
            inputs[atr.name] = sha256_file(atr)
    elif use_annotations and on_missing_annotations == "error":
        raise RecordError(name, f"annotation file {atr.name} is missing ({atr}) and on_missing_annotations=error")
    beats, symbols, beat_rh, source, det_stats = _beats(
        name, sig, gain_per_mv, fs, lead_name, ann if use_annotations else None, ann, detector_check, detector)
    return EcgRecord(
        name=name, fs=fs, lead=lead_name, signal=sig, gain_per_mv=gain_per_mv,
        beat_samples=np.asarray(beats, dtype=np.int64), beat_symbols=np.asarray(symbols, dtype=np.int16),
        beat_rhythms=np.asarray(beat_rh, dtype=np.int16), rhythms=ann.rhythms if ann is not None else [],
        beat_source=source, annotated_beats=int(ann.samples.size) if ann is not None else 0,
        detector=det_stats, inputs=inputs, notes=notes,
        dropped=list(ann.outside) if use_annotations and ann is not None else [],
        signal2=sig2, lead2=lead2, gain2_per_mv=gain2,
    )


def _header_file(name: str, base: Path) -> Path:
    """The record's ``.hea``, which must exist."""
    hea = base.with_name(base.name + ".hea")
    if not hea.exists():
        raise RecordError(name, f"header {hea.name} is missing ({hea})")
    return hea


def _other_lead(name: str, header: Any, lead: str, lead_fallback: str) -> int:
    """Index of the second lead: the first signal other than the one ``lead`` / ``lead_fallback`` choose."""
    names = list(header.sig_name)
    if len(names) < 2:
        raise RecordError(name, f"second_lead needs a second signal: the record has one ({names[0]})")
    return 1 if _pick_lead(name, names, lead, lead_fallback, []) == 0 else 0


def _lead_signal(name: str, rec: Any, header: Any, lead: str, lead_fallback: str, full: bool,
                 notes: List[str]) -> Tuple[np.ndarray, str, float]:
    """(digital samples of the chosen lead, its name, ADC units per mV), checked."""
    ch = _pick_lead(name, list(header.sig_name), lead, lead_fallback, notes)
    if rec.d_signal is None or rec.d_signal.ndim != 2 or rec.d_signal.shape[1] <= ch:
        raise RecordError(name, f"signal file holds no samples for lead {header.sig_name[ch]}")
    sig = np.ascontiguousarray(rec.d_signal[:, ch])
    if sig.size == 0:
        raise RecordError(name, "signal has no samples")
    lead_name = header.sig_name[ch]
    if full:
        _check_checksum(name, header, ch, sig)
    _check_samples(name, sig, str(header.fmt[ch]), lead_name)
    return sig, lead_name, _gain_per_mv(name, header, ch)


def _beats(name: str, sig: np.ndarray, gain_per_mv: float, fs: float, lead_name: str, use: Optional["_Annotations"],
           ann: Optional["_Annotations"], detector_check: bool, detector: str) -> Tuple[Any, Any, Any, str, Any]:
    """(beat samples, symbols, rhythm indices, source, detector statistics).

    From ``use`` (the annotations, when they are to be used), else the R-peak detector, whose
    beats carry no symbol and the annotated rhythm of their time; the detector is compared
    with ``ann`` when both exist (``detector_check`` on annotated beats).
    """
    if use is not None and not detector_check:  # the usual case: no detector module loaded
        return use.samples, use.codes, use.rhythm_idx, "annotations", None
    from hlmtune.ecg_tokenizer.detector import compare_beats, detect_beats

    if use is not None:
        det_stats = compare_beats(use.samples, detect_beats(sig, gain_per_mv, fs, detector), fs)
        return use.samples, use.codes, use.rhythm_idx, "annotations", det_stats
    beats = detect_beats(sig, gain_per_mv, fs, detector)
    symbols = np.full(beats.size, -1, dtype=np.int16)
    beat_rh = np.full(beats.size, -1, dtype=np.int16)
    det_stats = None
    if ann is not None:
        det_stats = compare_beats(ann.samples, beats, fs)
        # Rhythm is a property of time: carry the annotated rhythm onto detected beats.
        if ann.rhythms:
            beat_rh = _rhythm_at(beats, ann.changes)
    if beats.size == 0:
        raise RecordError(name, f"the R-peak detector found no beats in lead {lead_name}")
    return beats, symbols, beat_rh, "detector", det_stats


# ---------------------------------------------------------------------------- load_record's steps
def _read_signal(name: str, base: Path, hea: Path, sampto: Optional[int]):
    """Read the digital samples and check the header's promises (format, rate, file sizes).

    Fast path: one ``wfdb.rdrecord`` call (it parses the header once; reading both leads of a
    format-212 file costs about the same as one). When wfdb fails, the header is read on its
    own to say exactly what is wrong.

    Returns:
        tuple: (wfdb record, header, sampling rate, signal file paths).
    """
    import wfdb

    full = sampto is None
    try:
        rec = wfdb.rdrecord(
            str(base), physical=False, sampto=None if full else int(sampto),
            return_res=16 if _formats_fit_int16(hea) else 64,
        )
    except Exception as e:  # wfdb raises many types for broken records
        header = _read_header(name, base, hea)
        _check_signal_files(name, base, header)
        raise RecordError(name, f"signal file unreadable: {type(e).__name__}: {e}") from None
    header = rec if full else _read_header(name, base, hea)
    if getattr(header, "seg_name", None) is not None:
        raise RecordError(name, "multi-segment records are not supported")
    if not header.n_sig:
        raise RecordError(name, "header lists no signals")
    fs = float(header.fs)
    if not fs > 0:
        raise RecordError(name, f"header sampling rate {header.fs} is not positive")
    return rec, header, fs, _check_signal_files(name, base, header)


def _check_checksum(name: str, header, ch: int, sig: np.ndarray) -> None:
    """WFDB checksum: the sum of the samples modulo 2**16 (headers write it signed or not)."""
    if header.checksum is None or header.checksum[ch] is None:
        return
    cs = int(sig.sum(dtype=np.int64)) & 0xFFFF
    if cs != int(header.checksum[ch]) & 0xFFFF:
        cs = cs - 65536 if cs >= 32768 else cs
        raise RecordError(
            name,
            f"header disagrees with signal file: checksum of {header.sig_name[ch]} is {cs}, header says {header.checksum[ch]}",
        )


def _check_samples(name: str, sig: np.ndarray, fmt: str, lead_name: str) -> None:
    """No invalid (NaN-coded) samples, not a constant signal."""
    from wfdb.io._signal import INVALID_SAMPLE_VALUE

    invalid = INVALID_SAMPLE_VALUE.get(fmt)
    lo, hi = int(sig.min()), int(sig.max())
    if invalid is not None and lo <= invalid:  # the NaN code is the format's minimum value
        bad = np.flatnonzero(sig == invalid)
        if bad.size:
            raise RecordError(
                name,
                f"NaN (invalid) samples in lead {lead_name}: {bad.size} of {sig.size}, first at sample {int(bad[0])}",
            )
    if lo == hi:
        raise RecordError(name, f"flat signal: lead {lead_name} is constant ({int(sig[0])}) over {sig.size} samples")


def _gain_per_mv(name: str, header, ch: int) -> float:
    """ADC units per mV of a lead, from its gain and physical unit."""
    gain = float(header.adc_gain[ch] or 200.0)  # WFDB: gain 0 means the default 200/mV
    unit = (header.units[ch] if header.units else "mV") or "mV"
    factor = _UNIT_TO_MV.get(unit.strip().lower())
    if factor is None:
        raise RecordError(name, f"lead {header.sig_name[ch]} has units {unit!r}, expected mV, uV or V")
    return gain / factor


@dataclass
class _Annotations:
    """Beat annotations of a record, sorted, with the rhythm in force at each beat.

    Attributes:
        samples (np.ndarray): (B,) int64 beat sample indices.
        codes (np.ndarray): (B,) int16 beat codes.
        rhythm_idx (np.ndarray): (B,) int16 index into ``rhythms`` (-1: none yet).
        rhythms (List[str]): rhythm names in order of first appearance.
        changes (Tuple[np.ndarray, np.ndarray]): (sample, rhythm index) of every rhythm change.
    """

    samples: np.ndarray
    codes: np.ndarray
    rhythm_idx: np.ndarray
    rhythms: List[str]
    changes: Tuple[np.ndarray, np.ndarray]
    outside: List[Dict[str, Any]] = field(default_factory=list)


def _read_annotations(
    name: str, base: Path, atr: Path, ext: str, sampto: Optional[int], n: int, on_unknown_symbols: str
) -> _Annotations:
    """Read, check and order the beat annotations.

    Args:
        sampto (Optional[int]): annotations up to this sample (a partial read), None for all.
        n (int): samples in the signal (beats must lie inside it).
    """
    import wfdb

    try:
        # Vectorised reader (same fields as wfdb.rdann); None = a construct it leaves to
        # wfdb (definitions at sample 0, undefined codes, damaged files).
        ann = read_mit_annotations(atr, sampto=sampto)
        if ann is None:
            ann = wfdb.rdann(str(base), ext, sampto=sampto)
    except Exception as e:
        raise RecordError(name, f"annotation file {atr.name} is unreadable: {type(e).__name__}: {e}") from None
    samples = np.asarray(ann.sample, dtype=np.int64)
    symbols = list(ann.symbol)
    aux = list(ann.aux_note or [""] * samples.size)
    if sampto is not None:  # a partial read keeps the annotations inside it
        inside = int(np.searchsorted(samples, n, side="left"))
        samples, symbols, aux = samples[:inside], symbols[:inside], (aux + [""] * inside)[:inside]
    # One dict lookup per annotation: beat code >= 0, non-beat -1, rhythm change -3,
    # anything else (undefined codes come back as NaN) -2.
    codes = np.fromiter((_CODES.get(sym, -2) for sym in symbols), dtype=np.int16, count=samples.size)
    unknown = np.flatnonzero(codes == -2)
    if unknown.size and on_unknown_symbols == "error":
        sym = symbols[int(unknown[0])]
        what = f"symbol {sym!r}" if isinstance(sym, str) else "code (not in the WFDB code table)"
        raise RecordError(name, f"unknown annotation {what} at sample {int(samples[unknown[0]])} in {atr.name}")
    # Rhythm in force at each annotation: forward-fill the last '+' with a rhythm note.
    rhythms: List[str] = []
    change = np.full(samples.size, -1, dtype=np.int64)
    for i in np.flatnonzero(codes == -3).tolist():
        r = rhythm_name(aux[i])
        if r:
            if r not in rhythms:
                rhythms.append(r)
            change[i] = rhythms.index(r)
    pos = np.maximum.accumulate(np.where(change >= 0, np.arange(samples.size), -1)) if samples.size else change
    rh_idx = np.where(pos >= 0, change[np.maximum(pos, 0)], -1).astype(np.int16)
    at = np.flatnonzero(change >= 0)
    changes = (samples[at], change[at].astype(np.int16))
    keep = codes >= 0
    beats, beat_codes, beat_rh = samples[keep], codes[keep], rh_idx[keep]
    # A beat annotation outside the signal (PhysioNet's own files have one a sample past the end)
    # is left out and counted, as a beat at a record edge is; the record's other beats stay.
    inside = (beats >= 0) & (beats < n)
    outside = [{"sample": int(b), "reason": f"annotation outside the signal ({n} samples)"} for b in beats[~inside]]
    # on_unknown_symbols="drop" (what `hlmtune eval --test-records` reads a test folder with):
    # annotations whose code is not in the WFDB table are left out and counted, never guessed
    outside += [{"sample": int(samples[i]), "reason": "annotation code outside the WFDB table"} for i in unknown.tolist()]
    beats, beat_codes, beat_rh = beats[inside], beat_codes[inside], beat_rh[inside]
    if beats.size and np.any(np.diff(beats) <= 0):
        order = np.argsort(beats, kind="stable")
        beats, beat_codes, beat_rh = beats[order], beat_codes[order], beat_rh[order]
        dup = np.flatnonzero(np.diff(beats) == 0)
        if dup.size:
            raise RecordError(name, f"two beat annotations at sample {int(beats[dup[0]])} in {atr.name}")
    return _Annotations(beats, beat_codes, beat_rh, rhythms, changes, outside)


def _rhythm_at(beats: np.ndarray, changes: Tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Rhythm index in force at each sample of ``beats``, from the (sample, index) rhythm changes."""
    starts, idx = changes
    pos = np.searchsorted(starts, beats, side="right") - 1
    out = np.where(pos >= 0, idx[np.maximum(pos, 0)], -1)
    return out.astype(np.int16)
