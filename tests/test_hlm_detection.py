"""Detector mode: a deleted detection counts as missed, an added one as extra (hand-built cases)."""

from __future__ import annotations

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
