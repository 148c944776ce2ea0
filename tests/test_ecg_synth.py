"""Synthetic WFDB source: deterministic files, labeled beats, AF episodes, detectable."""

from __future__ import annotations

import numpy as np

from hlmtune.ecg_tokenizer.records import load_record
from hlmtune.ecg_tokenizer.synth import synthesize_record, write_synthetic_database


def test_deterministic_and_labeled(tmp_path):
    a = write_synthetic_database(tmp_path / "a", n_records=2, duration_s=60, seed=3)
    write_synthetic_database(tmp_path / "b", n_records=2, duration_s=60, seed=3)
    for p in sorted((tmp_path / "a").iterdir()):
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes(), p.name
    assert a == ["s000", "s001"] and (tmp_path / "a" / "RECORDS").read_text() == "s000\ns001\n"
    rec = load_record(tmp_path / "a", "s000", detector_check=True)
    syms = {rec.beat_symbols.tolist().count(i) for i in set(rec.beat_symbols.tolist())}
    assert rec.fs == 360 and rec.lead == "MLII" and len(syms) >= 1
    assert rec.rhythms == ["(N", "(AFIB"]
    af = rec.beat_rhythms == 1
    rr = np.diff(rec.beat_samples) / rec.fs
    # AF beats are irregular, sinus beats regular (outside ectopics)
    assert np.std(rr[af[1:] & af[:-1]]) > 0.1
    assert rec.detector["sensitivity"] > 0.98 and rec.detector["positive_predictivity"] > 0.98


def test_ectopic_beats_present(tmp_path):
    truth = synthesize_record("x", tmp_path, duration_s=120, seed=1, pvc_rate=0.2, apb_rate=0.1, af_fraction=0.0)
    rec = load_record(tmp_path, "x")
    assert np.array_equal(rec.beat_samples, truth["samples"])
    from hlmtune.ecg_tokenizer.labels import BEAT_SYMBOLS

    got = [BEAT_SYMBOLS[i] for i in rec.beat_symbols]
    assert got == truth["symbols"] and {"N", "V", "A"} <= set(got) and rec.rhythms == ["(N"]
