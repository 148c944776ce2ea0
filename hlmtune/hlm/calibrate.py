"""Class-bias calibration of the HLM classifier, fitted on DS1 out-of-fold predictions only.

The fine-tuning data are class-balanced (``balance: 0.5``) and hold synthetic premature beats
labelled S, so the model's class probabilities carry the training draw's class shares, not the
patients'. A per-class additive bias on the class log-probabilities (``argmax(log p + b)``) is
the decision threshold of a multi-class classifier; choosing it is model selection, so it is
fitted on predictions for DS1 patients the model did not train on (the out-of-fold predictions
of ``hlmtune cv``) and never on the test split. ``hlmtune eval --calibration FILE`` applies it
and refuses a file fitted on any test record.

The fit maximises macro-F1 (the issue's figure of merit) by coordinate ascent over a grid, the
first class (N) fixed at 0 (only differences matter). ``nested_predictions`` gives the honest
estimate of what calibration buys: each fold is predicted with a bias fitted on the other folds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

# Bias grid in nats: +-4 covers a 55x change of a class's odds, far beyond the ~10x over-draw of
# S in the balanced training set; 0.25 nats is finer than the fit's run-to-run noise.
GRID = np.round(np.arange(-4.0, 4.0 + 1e-9, 0.25), 2)
ROUNDS = 3  # coordinate-ascent sweeps; the fits seen converge in 2


def macro_f1(truth: np.ndarray, pred: np.ndarray, n_classes: int, scored: Optional[Sequence[int]] = None) -> float:
    """Mean F1 over the classes that have test examples (as ``evaluate.summarize``); with
    ``scored``, over those of the listed classes only."""
    truth = np.asarray(truth)
    pred = np.asarray(pred)
    f1s = []
    for c in (range(n_classes) if scored is None else scored):
        support = int((truth == c).sum())
        if not support:
            continue
        tp = int(((truth == c) & (pred == c)).sum())
        predicted = int((pred == c).sum())
        f1s.append(2.0 * tp / (support + predicted))  # = 2 Se +P / (Se + +P); 0 when tp = 0
    return float(np.mean(f1s)) if f1s else 0.0


def apply_bias(logprobs: np.ndarray, bias: Sequence[float]) -> np.ndarray:
    """Class index per row of ``argmax(logprobs + bias)``; logprobs (Q, C)."""
    return np.argmax(np.asarray(logprobs, dtype=np.float64) + np.asarray(bias, dtype=np.float64)[None, :], axis=1)


def fit_class_bias(logprobs: np.ndarray, truth: np.ndarray, *, grid: Sequence[float] = GRID,
                   rounds: int = ROUNDS, scored: Optional[Sequence[int]] = None) -> np.ndarray:
    """The per-class bias (first class fixed at 0) maximising macro-F1 of ``argmax(logprobs + b)``.

    Coordinate ascent: each sweep sets every other class's bias, in turn, to the grid value of
    highest macro-F1 given the rest; ties go to the value nearest 0 (the uncalibrated model). A
    class without examples in ``truth`` keeps bias 0: the data say nothing about it.

    Args:
        logprobs (np.ndarray): (Q, C) class log-probabilities.
        truth (np.ndarray): (Q,) true class indices.
        grid (Sequence[float]): candidate values of one class's bias.
        rounds (int): sweeps over the classes.
        scored (Optional[Sequence[int]]): the classes whose F1 the objective averages and whose
            bias moves (default: all); the others keep bias 0, e.g. a class whose examples come
            from one or two patients, where a fitted bias would describe those patients.

    Returns:
        np.ndarray: (C,) float64 bias.
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    truth = np.asarray(truth)
    if lp.ndim != 2 or lp.shape[0] != truth.shape[0]:
        raise ValueError(f"logprobs must be (Q, C) with Q = len(truth); got {lp.shape} and {truth.shape}")
    n = lp.shape[1]
    bias = np.zeros(n)
    best = macro_f1(truth, apply_bias(lp, bias), n, scored)
    by_distance = sorted(grid, key=lambda g: (abs(g), g))  # ties keep the value nearest 0
    movable = [c for c in range(1, n) if (truth == c).any() and (scored is None or c in scored)]
    for _ in range(rounds):
        moved = False
        for c in movable:
            keep = bias[c]
            for g in by_distance:
                bias[c] = g
                f = macro_f1(truth, apply_bias(lp, bias), n, scored)
                if f > best + 1e-12 or (abs(f - best) <= 1e-12 and abs(g) < abs(keep)):
                    best, keep, moved = f, g, moved or g != keep
            bias[c] = keep
        if not moved:
            break
    return bias


def nested_predictions(folds: Sequence[Tuple[np.ndarray, np.ndarray]], *,
                       scored: Optional[Sequence[int]] = None) -> List[np.ndarray]:
    """Each fold's predictions with a bias fitted on the other folds only.

    Args:
        folds (Sequence[Tuple[np.ndarray, np.ndarray]]): per fold, (logprobs (Q_k, C), truth (Q_k,)).
        scored (Optional[Sequence[int]]): as :func:`fit_class_bias`.

    Returns:
        List[np.ndarray]: per fold, the predicted class indices.
    """
    if len(folds) < 2:
        raise ValueError("nested calibration needs at least 2 folds")
    out = []
    for k in range(len(folds)):
        lp = np.concatenate([f[0] for j, f in enumerate(folds) if j != k])
        tr = np.concatenate([f[1] for j, f in enumerate(folds) if j != k])
        out.append(apply_bias(folds[k][0], fit_class_bias(lp, tr, scored=scored)))
    return out


def write_calibration(path: Path, *, classes: Sequence[str], bias: Sequence[float], records: Sequence[str],
                      source: str, summary: Dict[str, Any]) -> None:
    """Write a calibration file (atomic): the bias per class and the records it was fitted on."""
    from hlmtune.files import atomic_write_text

    doc = {
        "kind": "hlm_class_bias",
        "classes": list(classes),
        "bias": {c: float(b) for c, b in zip(classes, bias)},
        "fitted_on_records": list(records),
        "source": source,
        **summary,
    }
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")


def load_calibration(path: Path, *, classes: Sequence[str], test_records: Optional[Sequence[str]]) -> np.ndarray:
    """The bias vector of a calibration file, checked against the evaluation it is applied to.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a calibration file, other classes, or fitted on a test record (a bias
            chosen by looking at the test patients would tune on the test split).
    """
    from hlmtune.ecg_tokenizer.splits import check_disjoint

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--calibration {p}: no such file (hlmtune cv writes calibration.json)")
    try:
        doc = json.loads(p.read_text())
    except ValueError as e:
        raise ValueError(f"--calibration {p}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != "hlm_class_bias" or not isinstance(doc.get("bias"), dict):
        raise ValueError(f"--calibration {p}: not a calibration file (hlmtune cv writes one: calibration.json)")
    if sorted(doc["bias"]) != sorted(classes):
        raise ValueError(f"--calibration {p}: fitted for classes {sorted(doc['bias'])}, this evaluation has {list(classes)}")
    fitted = doc.get("fitted_on_records")
    if not isinstance(fitted, list) or not all(isinstance(r, str) for r in fitted):
        # Without the list nothing shows the bias was not chosen on the test patients.
        raise ValueError(f"--calibration {p}: 'fitted_on_records' must list the records the bias was "
                         "fitted on (hlmtune cv writes it)")
    if test_records is not None:
        check_disjoint(fitted, test_records, what=f"--calibration {p}")
    return np.array([float(doc["bias"][c]) for c in classes])
