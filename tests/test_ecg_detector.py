"""R-peak detector (wfdb GQRS/XQRS) and the Se/+P comparison (150 ms window)."""

from __future__ import annotations

import numpy as np
import pytest

from hlmtune.ecg_tokenizer.detector import compare_beats, detect_beats
from hlmtune.ecg_tokenizer.records import load_record


def test_compare_beats_counts():
    ref = np.array([100, 400, 700, 1000])
    det = np.array([110, 460, 705, 1500, 1800])  # 460 is 60 samples = 167 ms away at 360 Hz
    c = compare_beats(ref, det, 360.0)
    assert (c["tp"], c["fn"], c["fp"]) == (2, 2, 3)
    assert c["sensitivity"] == 0.5 and c["positive_predictivity"] == 0.4 and c["window_s"] == 0.15


@pytest.mark.parametrize("name,method", [("100", "gqrs"), ("208", "gqrs"), ("100", "xqrs")])
def test_detector_on_real_records(real_mitdb_dir, name, method):
    rec = load_record(real_mitdb_dir, name, sampto=360 * 120)
    det = detect_beats(rec.signal, rec.gain_per_mv, rec.fs, method)
    c = compare_beats(rec.beat_samples, det, rec.fs)
    assert c["sensitivity"] > 0.97 and c["positive_predictivity"] > 0.97, c
    # peaks are moved onto the R wave: most within 30 ms of the reference annotation
    near = np.abs(det[:, None] - rec.beat_samples[None, :]).min(axis=1)
    assert np.median(near) <= 0.03 * rec.fs


def test_unknown_detector():
    with pytest.raises(ValueError, match="detector must be one of"):
        detect_beats(np.zeros(10, dtype=np.int64), 200.0, 360.0, "pan-tompkins")
