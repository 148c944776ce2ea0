"""Class-bias calibration: the fit against an exhaustive search, nesting, and the file's guards."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from hlmtune.hlm import calibrate as cal
from hlmtune.hlm import evaluate as ev
from hlmtune.ecg_tokenizer.splits import SplitError


def _toy(n: int, seed: int, shift=(0.0, -2.0, -1.0)):
    """Three classes; the model under-rates classes 1 and 2 by ``-shift`` nats (as a balanced draw
    with a different class mix would): the right bias moves them back."""
    rng = np.random.default_rng(seed)
    truth = rng.choice(3, size=n, p=[0.8, 0.08, 0.12])
    logits = rng.normal(0.0, 1.0, size=(n, 3))
    logits[np.arange(n), truth] += 2.5  # evidence for the true class
    logits += np.asarray(shift)[None, :]
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    return lp, truth


def test_macro_f1_is_evaluates_macro_f1():
    rng = np.random.default_rng(0)
    for _ in range(20):
        truth = rng.integers(0, 4, 300)
        truth[truth == 3] = 0  # class 3 without test examples: it does not count
        pred = rng.integers(0, 4, 300)
        want = ev.summarize(ev.confusion_matrix(truth.tolist(), pred.tolist(), 4), ["N", "S", "V", "F"])["macro_f1"]
        assert cal.macro_f1(truth, pred, 4) == pytest.approx(want)


def test_fit_reaches_the_exhaustive_grid_optimum():
    lp, truth = _toy(3000, seed=1)
    bias = cal.fit_class_bias(lp, truth)
    assert bias[0] == 0.0
    got = cal.macro_f1(truth, cal.apply_bias(lp, bias), 3)
    best = max(cal.macro_f1(truth, cal.apply_bias(lp, (0.0, a, b)), 3)
               for a, b in itertools.product(cal.GRID, cal.GRID))
    assert got == pytest.approx(best, abs=1e-9)
    assert got > cal.macro_f1(truth, lp.argmax(1), 3) + 0.02  # the under-rated classes gain
    assert bias[1] > 0 and bias[2] > 0  # and the bias undoes the under-rating's sign


def test_a_class_without_examples_keeps_bias_zero_and_ties_stay_at_zero():
    lp, truth = _toy(2000, seed=2)
    lp4 = np.concatenate([lp, np.full((len(lp), 1), -3.0)], axis=1)  # class 3 never occurs
    assert cal.fit_class_bias(lp4, truth)[3] == 0.0
    # a perfectly separated problem: every bias near 0 is optimal, so none moves
    truth = np.array([0, 1, 2] * 50)
    lp = np.log(np.full((150, 3), 0.01))
    lp[np.arange(150), truth] = np.log(0.98)
    assert cal.fit_class_bias(lp, truth).tolist() == [0.0, 0.0, 0.0]


def test_scored_classes_alone_count_and_move():
    lp, truth = _toy(3000, seed=6)
    b = cal.fit_class_bias(lp, truth, scored=[0, 1])
    assert b[2] == 0.0 and b[1] != 0.0  # class 2 is not scored: its bias stays
    got = cal.macro_f1(truth, cal.apply_bias(lp, b), 3, scored=[0, 1])
    assert got == pytest.approx(max(cal.macro_f1(truth, cal.apply_bias(lp, (0.0, a, 0.0)), 3, scored=[0, 1])
                                    for a in cal.GRID))
    # the scored objective is the mean F1 of the listed classes only
    pred = lp.argmax(1)
    per = ev.summarize(ev.confusion_matrix(truth.tolist(), pred.tolist(), 3), ["N", "S", "V"])["per_class"]
    assert cal.macro_f1(truth, pred, 3, scored=[0, 1]) == pytest.approx((per["N"]["f1"] + per["S"]["f1"]) / 2)


def test_nested_predictions_never_use_the_predicted_folds_labels():
    folds = [_toy(800, seed=s) for s in (3, 4, 5)]
    preds = cal.nested_predictions(folds)
    for k, (lp, truth) in enumerate(folds):
        others = [f for j, f in enumerate(folds) if j != k]
        b = cal.fit_class_bias(np.concatenate([f[0] for f in others]), np.concatenate([f[1] for f in others]))
        assert np.array_equal(preds[k], cal.apply_bias(lp, b))
    # the predicted fold's own labels changed: its predictions stay the same
    shuffled = list(folds)
    shuffled[0] = (folds[0][0], np.random.default_rng(9).permutation(folds[0][1]))
    assert np.array_equal(cal.nested_predictions(shuffled)[0], preds[0])
    with pytest.raises(ValueError, match="at least 2 folds"):
        cal.nested_predictions(folds[:1])


def test_calibration_file_round_trip_and_guards(tmp_path):
    path = tmp_path / "calibration.json"
    cal.write_calibration(path, classes=["N", "S", "V"], bias=[0.0, -1.25, 0.5], records=["101", "106"],
                          source="test", summary={"folds": 2})
    assert cal.load_calibration(path, classes=["N", "S", "V"], test_records=["100"]).tolist() == [0.0, -1.25, 0.5]
    assert cal.load_calibration(path, classes=["V", "N", "S"], test_records=None).tolist() == [0.5, 0.0, -1.25]
    with pytest.raises(SplitError, match=r"\['106'\]"):  # fitted on a test patient: tuning on the test split
        cal.load_calibration(path, classes=["N", "S", "V"], test_records=["106", "100"])
    with pytest.raises(ValueError, match="classes"):
        cal.load_calibration(path, classes=["N", "S", "V", "F"], test_records=None)
    # without the list of records it was fitted on, or with a string for it, nothing shows the
    # bias was not fitted on the test patients
    doc = json.loads(path.read_text())
    for fitted in (None, "106"):
        bad = dict(doc) if fitted is not None else {k: v for k, v in doc.items() if k != "fitted_on_records"}
        if fitted is not None:
            bad["fitted_on_records"] = fitted
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="'fitted_on_records' must list the records"):
            cal.load_calibration(path, classes=["N", "S", "V"], test_records=["100"])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"N": 0}))
    with pytest.raises(ValueError, match="not a calibration file"):
        cal.load_calibration(other, classes=["N"], test_records=None)
    other.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        cal.load_calibration(other, classes=["N"], test_records=None)
    with pytest.raises(FileNotFoundError, match="hlmtune cv"):
        cal.load_calibration(tmp_path / "missing.json", classes=["N"], test_records=None)
