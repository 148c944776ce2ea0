"""Detector mode: a deleted detection counts as missed, an added one as extra (hand-built cases)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hlmtune.hlm.detection import match_beats
from hlmtune.hlm.evaluate import EvalSet, result_row


def test_a_deleted_detection_is_missed_and_an_added_one_is_extra():
    fs = 360.0
    ref = np.array([1000, 1400, 1800, 2200])
    # 1400 deleted, 1800 found 40 ms late (within 150 ms), 2200 found 200 ms late (outside: one
    # missed beat and one extra detection), 3000 added
    det = np.array([1003, 1814, 2272, 3000])
    kept = np.ones(det.size, bool)
    det_ref, missed, left_out = match_beats(ref, det, kept, fs, 0.15)
    assert det_ref.tolist() == [0, 2, -1, -1]
    assert missed.tolist() == [False, True, False, True] and not left_out.any()
    # a detection at a record edge (not tokenized) leaves its reference beat out of the score
    _, missed2, left_out2 = match_beats(ref, det, np.array([False, True, True, True]), fs, 0.15)
    assert left_out2.tolist() == [True, False, False, False] and missed2.tolist() == missed.tolist()


def test_missed_beats_lower_se_and_extra_detections_lower_ppv():
    classes = ["N", "S", "V"]
    # three classified detections: N right, an extra detection (truth "no beat" = 3) called S, V right
    test = EvalSet("beat", classes, [0, 1, 2], [[0]] * 3, truth=[0, 3, 2], records=["a", "a", "b"],
                   n=3, n_total=3, missed=[("a", 1), ("b", 2)], no_beat=True)
    r = result_row(test, [0, 1, 2])
    pc = r["per_class"]
    assert r["confusion"] == [[1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 0, 0]]
    assert (pc["N"]["se"], pc["N"]["ppv"]) == (1.0, 1.0)
    assert (pc["S"]["support"], pc["S"]["se"], pc["S"]["fp"], pc["S"]["ppv"]) == (1, 0.0, 1, 0.0)  # missed + extra
    assert (pc["V"]["se"], pc["V"]["ppv"]) == (0.5, 1.0)  # one of two V beats detected
    assert set(r["per_record"]) == {"a", "b"} and r["per_record"]["b"]["per_class"]["V"]["fn"] == 1


def _hand_built_record(folder, name, samples, symbols, fs=360, seconds=10):
    """A one-lead WFDB record (MLII, seeded noise: the matching reads only its annotations and
    rate) whose beat annotations are ``samples`` / ``symbols``."""
    import wfdb

    signal = np.random.default_rng(0).normal(0.0, 0.1, (int(fs * seconds), 1))
    wfdb.wrsamp(name, fs=fs, units=["mV"], sig_name=["MLII"], p_signal=signal,
                fmt=["212"], adc_gain=[200.0], baseline=[0], write_dir=str(folder))
    wfdb.wrann(name, "atr", np.asarray(samples), symbol=list(symbols), write_dir=str(folder))
    return folder / name


def _detector_manifest(folder, records):
    """What ``detector_shards`` writes, reduced to what the matching reads: per record (id, WFDB
    source, kept detection samples, dropped detection samples)."""
    from hlmtune.ecg_tokenizer.core import BEAT_DTYPE

    metas = []
    for rid, source, kept, dropped in records:
        table = np.zeros(len(kept), BEAT_DTYPE)
        table["sample"] = kept
        name = f"{Path(source).name}.beats.npy"
        np.save(folder / name, table)
        metas.append({"record": rid, "source": str(source), "outputs": {"beats": {"file": name}},
                      "dropped": [{"sample": s, "reason": "window ends after the record"} for s in dropped]})
    return {"_dir": str(folder), "records": metas}


def test_detector_matching_labels_detections_and_counts_misses_by_class(tmp_path):
    """Each detection gets its reference beat's AAMI class, an extra one the placeholder; a deleted
    beat of a scored class is missed under its class, one of an unscored class (Q) is not, a beat
    found only at a record edge is left out of every count, and the counts add over records."""
    from hlmtune.ecg_tokenizer.labels import label_classes
    from hlmtune.hlm.detection import detector_matching

    classes = label_classes("aami")
    n, s, v, f, q = (classes.index(c) for c in "NSVFQ")
    # record a: V, A (S), N, N, F, Q ('Q' is AAMI Q), j (junctional escape: AAMI N)
    a = _hand_built_record(tmp_path, "a", [500, 900, 1300, 1700, 2100, 2500, 2900], ["V", "A", "N", "N", "F", "Q", "j"])
    # record b: N, S, V
    b = _hand_built_record(tmp_path, "b", [400, 800, 1200], ["N", "S", "V"])
    manifest = _detector_manifest(tmp_path, [
        # a: V found 3 samples late; A deleted; N 10 late; 1700 found only at an edge (dropped); F and Q
        # deleted; j found; an extra detection at 3300
        ("db/a", a, [503, 1310, 2905, 3300], [1702]),
        # b: N found; S and V deleted
        ("db/b", b, [405], []),
    ])
    m = detector_matching(manifest, class_ids=[n, s, v, f], placeholder=q, label_mode="aami", window_s=0.15)
    assert m.labels["db/a"].tolist() == [v, n, n, q] and m.labels["db/b"].tolist() == [n]
    assert m.extra["db/a"].tolist() == [False, False, False, True] and m.extra["db/b"].tolist() == [False]
    assert sorted(m.missed) == sorted([("db/a", s), ("db/a", f), ("db/b", s), ("db/b", v)])
    # scored reference beats: a's 500, 900, 1300, 2100, 2900 (not 1700: left out; not 2500: Q), b's three
    assert m.detector == {"matched": 4, "missed": 4, "extra": 1, "window_s": 0.15,
                          "sensitivity": 4 / 8, "positive_predictivity": 4 / 5}
    # shards of the first 1,000 samples (sampto, as the detector's shards record it): b's V at 1200 is
    # outside what was read, neither missed nor scored
    part = _detector_manifest(tmp_path, [("db/b", b, [405, 805], [])])
    part["options"] = {"sampto": 1000}
    m = detector_matching(part, class_ids=[n, s, v, f], placeholder=q, label_mode="aami", window_s=0.15)
    assert m.missed == [] and (m.detector["matched"], m.detector["missed"]) == (2, 0)
    # the reference is read from the annotation file the shards name (here .ref: only N and S)
    import wfdb

    c = _hand_built_record(tmp_path, "c", [400, 800], ["N", "S"])
    (tmp_path / "c.atr").rename(tmp_path / "c.ref")
    wfdb.wrann("c", "atr", np.array([400, 800, 1200]), symbol=["V", "V", "V"], write_dir=str(tmp_path))
    other = _detector_manifest(tmp_path, [("db/c", c, [405], [])])
    other["options"] = {"annotation_ext": "ref"}
    m = detector_matching(other, class_ids=[n, s, v, f], placeholder=q, label_mode="aami", window_s=0.15)
    assert m.labels["db/c"].tolist() == [n] and m.missed == [("db/c", s)]


def test_matching_with_no_detections_or_no_reference_beats():
    ref, det = np.array([100, 500]), np.array([300, 900, 1300])
    det_ref, missed, left_out = match_beats(ref, np.array([], np.int64), np.array([], bool), 360.0, 0.15)
    assert det_ref.size == 0 and missed.tolist() == [True, True] and left_out.tolist() == [False, False]
    det_ref, missed, left_out = match_beats(np.array([], np.int64), det, np.ones(3, bool), 360.0, 0.15)
    assert det_ref.tolist() == [-1, -1, -1] and missed.size == 0 and left_out.size == 0
    assert match_beats(ref, det, np.ones(3, bool), 360.0, 0.15)[0].tolist() == [-1, -1, -1]  # all > 150 ms away


def test_detector_shards_read_the_test_shards_lead_and_stretch(tmp_path):
    """The detector runs on the lead and the first ``sampto`` samples the test shards were read
    with (so both modes score the same beats), and its beats match the reference annotations."""
    from hlmtune.ecg_tokenizer.labels import label_classes
    from hlmtune.ecg_tokenizer.shards import read_manifest
    from hlmtune.ecg_tokenizer.synth import write_synthetic_database
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams
    from hlmtune.hlm.detection import detector_matching, detector_shards

    db = tmp_path / "syn"
    write_synthetic_database(db, n_records=1, duration_s=60.0, seed=3)
    params = TokenizerParams()
    test_manifest = {"params": params.to_dict(), "records": [{"record": "syn/s000", "source": str(db / "s000")}],
                     "options": {"lead": "V1", "lead_fallback": "error", "annotation_ext": "atr", "sampto": 360 * 30}}
    det = read_manifest(detector_shards(test_manifest, ["syn/s000"], tmp_path / "out", detector="gqrs"))
    (rec,) = det["records"]
    assert (rec["record"], rec["lead"], rec["n_samples"], rec["beat_source"]) == ("syn/s000", "V1", 360 * 30, "detector")
    assert det["options"]["sampto"] == 360 * 30 and det["options"]["use_annotations"] is False
    classes = label_classes(params.label_mode)
    m = detector_matching(det, class_ids=list(range(len(classes) - 1)), placeholder=0, label_mode=params.label_mode,
                          window_s=0.15)
    assert m.detector["sensitivity"] > 0.95 and m.detector["positive_predictivity"] > 0.95, m.detector


def test_detector_shards_name_a_test_record_whose_wfdb_files_are_gone(tmp_path):
    import pytest

    from hlmtune.ecg_tokenizer.vocab import TokenizerParams
    from hlmtune.hlm.detection import detector_shards

    manifest = {"params": TokenizerParams().to_dict(), "options": {},
                "records": [{"record": "db/7", "source": str(tmp_path / "gone" / "7")}, {"record": "db/8"}]}
    for rid, where in (("db/7", str(tmp_path / "gone" / "7")), ("db/8", "no source recorded")):
        with pytest.raises(FileNotFoundError, match=f"test record {rid} are not where its shards say \\({where}\\)"):
            detector_shards(manifest, [rid], tmp_path / "out", detector="gqrs")
