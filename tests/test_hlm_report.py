"""Report headers and tables of HLM evaluations (:mod:`hlmtune.hlm.report`)."""

from __future__ import annotations

from hlmtune.ecg_tokenizer.labels import MITDB_DS1, MITDB_DS2
from hlmtune.hlm.report import BASELINES, baseline_table, detector_summary, held_out_described, trained_on


def test_a_cv_fold_header_does_not_call_its_held_out_patients_mitdb_ds2():
    held_out = ["mitdb/108", "mitdb/109", "svdb/808"]
    assert held_out_described("DS2", list(MITDB_DS2), split_file=None) == "DS2 (unseen patients)"
    assert held_out_described("DS2", held_out, split_file=None) == "DS2 (unseen patients)"
    fold = held_out_described("DS2", held_out, split_file="/x/fold2/db/splits.json")
    assert fold == "split file DS2 (3 records held out of training, not MIT-BIH DS2)"
    # A split file whose DS2 is MIT-BIH's own (bare or prefixed ids) is MIT-BIH DS2.
    for ids in (list(MITDB_DS2), [f"mitdb/{r}" for r in MITDB_DS2]):
        assert held_out_described("DS2", ids, split_file="s.json") == "DS2 (unseen patients)"
    # One record short, or one from another database, is not.
    assert "not MIT-BIH DS2" in held_out_described("DS2", list(MITDB_DS2[1:]), split_file="s.json")
    assert "not MIT-BIH DS2" in held_out_described("DS2", [*MITDB_DS2[1:], "svdb/100"], split_file="s.json")
    assert "not MIT-BIH DS2" in held_out_described("DS2", [*MITDB_DS2, "svdb/800"], split_file="s.json")


def test_trained_on_counts_each_database():
    train = [*(f"mitdb/{r}" for r in MITDB_DS1[:3]), "svdb/800", "svdb/801"]
    assert trained_on(train, ["mitdb/100"], split_file=None) == "DS1 3 + svdb 2"
    assert trained_on(train[:3], ["mitdb/100"], split_file="s.json") == "split file DS1"


def test_the_baseline_table_prints_the_papers_figures_exactly():
    table = baseline_table({})
    assert "| de Chazal et al. 2004 (linear discriminants) | 75.9 | 38.5 | - | 77.7 | 81.9 | - |" in table
    assert "| Niu et al. 2020 (symbolized beats + CNN) | - | - | 0.766 | - | - | 0.897 |" in table
    assert len(BASELINES) == 3


def test_the_detector_summary_states_its_counts_and_how_they_are_scored():
    beats = {"positions": "detector", "detector": "xqrs", "matched": 3, "missed": 1, "extra": 2, "window_s": 0.15,
             "sensitivity": 0.75, "positive_predictivity": 0.6}
    text = detector_summary(beats)
    assert text.startswith("Beats: the xqrs QRS detector found 3 of the 4 reference beats of the scored classes "
                           "within 150 ms (Se 75.0 %) and made 2 detections with no reference beat (+P 60.0 %).")
    assert '"no beat" column' in text and '"no beat" row' in text
