"""``hlmtune eval --beats detector``: beats as a device finds them, scored as ANSI/AAMI EC57 does.

The published inter-patient figures, and the pack's by default, classify the reference
annotations' beats at their annotated R-peak positions. A device has no annotations: a QRS
detector finds the beats. In this mode the test records are tokenized again with beats from
the detector (the tokenizer's ``gqrs`` or wfdb's ``xqrs``), each detection is matched to a
reference beat within 150 ms (EC57's match window, ``ecg_tokenizer.detector.MATCH_WINDOW_S``),
and:

* a detection matched to a reference beat is classified and scored against that beat's class;
* a reference beat with no detection is **missed**: a false negative of its class (its row of
  the confusion matrix gains a "no beat" column);
* a detection with no reference beat is **extra**: its predicted class gains a false positive
  (the confusion matrix gains a "no beat" row), against that class's +P.

Beats whose window leaves the record (the first and last fraction of a second) are not
classified in either mode; a reference beat whose only detection sits there is left out too.
Both modes read the same stretch of the same lead: the detector's shards take the test shards'
record options (lead, its fallback, annotation file, ``sampto``), and the reference beats are
read with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

NO_BEAT = "no beat"  # the extra row / column of a detector-mode confusion matrix


@dataclass
class Matching:
    """How a test set's detections meet its reference beats.

    Attributes:
        labels (Dict[str, np.ndarray]): per record, (n_table_beats,) class id of each detected
            beat of the detector shards (the matched reference beat's; ``placeholder`` for extras).
        extra (Dict[str, np.ndarray]): per record, (n_table_beats,) bool: no reference beat.
        missed (List[Tuple[str, int]]): (record, class id) of every reference beat no kept
            detection matched.
        detector (Dict[str, Any]): Se / +P of the detector over the test records.
    """

    labels: Dict[str, np.ndarray] = field(default_factory=dict)
    extra: Dict[str, np.ndarray] = field(default_factory=dict)
    missed: List[Tuple[str, int]] = field(default_factory=list)
    detector: Dict[str, Any] = field(default_factory=dict)


def match_beats(reference: np.ndarray, detected: np.ndarray, kept: np.ndarray,
                fs: float, window_s: float) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Match detections to reference beats (one-to-one, nearest first, within ``window_s``).

    Args:
        reference (np.ndarray): (R,) reference beat samples, increasing.
        detected (np.ndarray): (D,) detected beat samples, increasing.
        kept (np.ndarray): (D,) bool: the detection was tokenized (its window is inside the record).
        fs (float): sampling rate (Hz).
        window_s (float): match window (s).

    Returns:
        Tuple[np.ndarray, np.ndarray, np.ndarray]: per detection its matched reference index or
        -1; per reference beat whether it is missed (no detection at all); per reference beat
        whether it is left out (matched only to a detection at a record edge).
    """
    import wfdb.processing as wp

    det_ref = np.full(detected.size, -1, np.int64)
    missed = np.ones(reference.size, bool)
    if reference.size and detected.size:
        cmp = wp.compare_annotations(reference, detected, int(round(window_s * fs)))
        cmp.compare()
        m = np.asarray(cmp.matching_sample_nums, np.int64)  # (R,) detection index or -1
        hit = m >= 0
        det_ref[m[hit]] = np.flatnonzero(hit)
        missed = ~hit
    left_out = np.zeros(reference.size, bool)
    edge = (det_ref >= 0) & ~kept
    left_out[det_ref[edge]] = True
    return det_ref, missed, left_out


def _reading_options(manifest: Dict[str, Any]) -> Dict[str, Any]:
    """The record options of a shard set that choose which samples of which leads are read
    (:class:`~hlmtune.ecg_tokenizer.pipeline.RecordOptions`' defaults where its manifest has none)."""
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions

    default, opts = RecordOptions(), manifest.get("options") or {}
    return {k: opts.get(k, getattr(default, k)) for k in ("lead", "lead_fallback", "annotation_ext", "sampto",
                                                          "second_lead")}


def detector_matching(detector_manifest: Dict[str, Any], *, class_ids: Sequence[int],
                      placeholder: int, label_mode: str, window_s: float) -> Matching:
    """Labels, extras and misses of every test record (see the module docstring).

    Args:
        detector_manifest (Dict[str, Any]): the test records tokenized with detector beats (``source``
            of each: where their reference annotations are read; ``options``: which lead and samples).
        class_ids (Sequence[int]): the run's target classes (others are neither scored nor missed).
        placeholder (int): a target class id given to extra detections (never read: they score as "no beat").
        label_mode (str): the tokenizer's label mode.
        window_s (float): match window (s).

    Returns:
        Matching: what the evaluation scores.
    """
    from hlmtune.ecg_tokenizer.labels import BEAT_SYMBOLS, symbol_to_class
    from hlmtune.ecg_tokenizer.records import load_record

    to_class = symbol_to_class(label_mode)
    wanted = set(int(c) for c in class_ids)
    reading = {**_reading_options(detector_manifest), "second_lead": False}  # the reference beats: positions only
    out = Matching()
    tp = fn = fp = 0
    d = Path(detector_manifest["_dir"])
    for meta in detector_manifest["records"]:
        rid = meta["record"]
        src = Path(meta["source"])
        ref = load_record(src.parent, src.name, **reading, use_annotations=True, on_unknown_symbols="drop",
                          hash_inputs=False)
        ref_cls = np.array([to_class[BEAT_SYMBOLS[int(c)]] for c in ref.beat_symbols], np.int64)
        table = np.load(d / meta["outputs"]["beats"]["file"])
        # every detection, kept (tokenized) or not: the beat table holds the kept ones
        kept_samples = table["sample"].astype(np.int64)
        detected = np.union1d(kept_samples, np.asarray([x["sample"] for x in meta["dropped"]], np.int64))
        kept = np.isin(detected, kept_samples)
        det_ref, missed, left_out = match_beats(ref.beat_samples, detected, kept, ref.fs, window_s)
        at = np.searchsorted(detected, kept_samples)  # table beat -> detection index
        matched = det_ref[at]
        labels = np.where(matched >= 0, ref_cls[np.maximum(matched, 0)], placeholder)
        extra = matched < 0
        out.labels[rid], out.extra[rid] = labels, extra
        scored = np.isin(ref_cls, list(wanted)) & ~left_out
        out.missed += [(rid, int(c)) for c in ref_cls[missed & scored]]
        tp += int((~missed & scored).sum())
        fn += int((missed & scored).sum())
        fp += int(extra.sum())
    out.detector = {"matched": tp, "missed": fn, "extra": fp, "window_s": window_s,
                    "sensitivity": tp / (tp + fn) if tp + fn else None,
                    "positive_predictivity": tp / (tp + fp) if tp + fp else None}
    return out


def detector_shards(test_manifest: Dict[str, Any], test_ids: Sequence[str], out: Path, *, detector: str) -> Path:
    """Tokenize the test records again with beats from ``detector`` (ids kept, the test shards' lead
    and ``sampto``); returns the shards' folder.

    Raises:
        FileNotFoundError: a record whose WFDB files are not where its shards say (older shards
            record no source: tokenize again, or give ``--test-records``).
        RuntimeError: a record the detector run failed on.
    """
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, RecordSource, tokenize_sources
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    by_id = {r["record"]: r for r in test_manifest["records"]}
    groups: Dict[Tuple[str, str], List[str]] = {}
    for rid in test_ids:
        src = by_id[rid].get("source")
        if not src or not Path(f"{src}.hea").is_file():
            raise FileNotFoundError(f"--beats detector: the WFDB files of test record {rid} are not where its shards "
                                    f"say ({src or 'no source recorded'}): tokenize again, or give --test-records FOLDER")
        db = rid.rsplit("/", 1)[0] if "/" in rid else ""
        groups.setdefault((str(Path(src).parent), db), []).append(Path(src).name)
    sources = [RecordSource(Path(folder), db or None, names) for (folder, db), names in groups.items()]
    dest = out / f"test_tokens_{detector}"
    summary = tokenize_sources(sources, dest, params=TokenizerParams.from_dict(test_manifest["params"]),
                               options=RecordOptions(**_reading_options(test_manifest), use_annotations=False,
                                                     detector=detector, detector_check=False, on_unknown_symbols="drop"),
                               workers=1, progress=False)
    if not summary.ok:
        raise RuntimeError("--beats detector: records the detector run failed on:\n" + summary.format())
    return dest
