"""``hlmtune cv``: patient-wise K-fold cross-validation over the training patients, for model selection.

DS2 is the test split and chooses nothing. What does choose (inputs, example counts, decision
thresholds) needs held-out patients too, and one fold of five records is a noisy judge: two
seeds of one setting differed by 0.2 in S F1 on it (docs/hlm.md). ``hlmtune cv`` splits the
DS1 records into K folds (each record in one fold, the S and V beats spread evenly), runs the
main job's stages on each fold (tokenize -> pretrain on the fold's training records -> LoRA
fine-tune -> predict the held-out fold's beats), and pools the out-of-fold predictions: every
DS1 beat is predicted by a model that never saw its patient.

From the pooled predictions it writes:

- ``cv_metrics.json`` / ``report.md``: per-fold and pooled Se / +P / F1 per class and macro-F1;
- ``calibration.json``: the per-class bias on the class log-probabilities that maximises the
  pooled macro-F1 (:mod:`hlmtune.hlm.calibrate`), for ``hlmtune eval --calibration`` and
  ``hlmtune demo --calibration``; beside it, the honest estimate of what it buys: each fold
  predicted with a bias fitted on the other folds only (nested).

Fine-tuning overrides after the flags (``hlmtune cv ... dataset.next_rr=False``) apply to every
fold, so one command scores a setting. Reruns keep finished folds (``--force`` redoes them).
With ``--seeds`` above 1 the report also pools each ensemble member over the folds (the seed
spread a setting must beat), and ``--baseline DIR`` (an earlier ``hlmtune cv`` folder with the
same folds) puts this run beside it: fold by fold, pooled, and how many folds are at or above.
Each fold's row names its pretrained models by content (``pretrain_sha256``), and the comparison
says in which folds the baseline's differ: the fine-tunes reproduce bit for bit, but a
pretraining redone by code that sums in another order is another model (docs/hlm.md measured
what that alone moves), so a lever is judged against a baseline on the same pretrained models.
With ``--need-folds M`` beside ``--baseline`` a candidate stops as soon as fewer than M folds can
still end at or above the baseline (the adoption rule's fold count: docs/hlm.md): its verdict is
then known without the remaining folds, which on 2 CPU cores are half an hour each. A stopped run
writes ``cv_stopped.json`` and a report that says so, never ``cv_metrics.json``. ``--figure``
names what the fold count and the pooled difference judge (:data:`FIGURES`): macro-F1 (default),
or ``sv_f1``, the mean of the S and V F1, a figure that a class of a few hundred beats in two
folds (F) does not swing. ``--check-pretraining`` beside ``--baseline`` runs fold 1 only up to
its first pretrained model and writes ``pretrain_check.json``: whether this host pretrains to the
baseline's checkpoint bytes, i.e. computes as the host that made the baseline did (minutes, not
the hours a re-made baseline takes). ``--through-fold K`` runs folds 1..K only and writes
``cv_partial.json`` (those folds' rows, never pooled figures); a rerun with a larger K goes on from
the finished folds. A candidate may take such an unfinished baseline with ``--need-folds`` and a
``--through-fold`` no larger than the baseline's: it can then be rejected fold by fold beside a
baseline that is being made (``hlmtune select --interleave``), but judged in full only against a
finished one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hlmtune.helpformat import RawDefaultsHelpFormatter
from hlmtune.hlm.pipeline import FINETUNE_EXAMPLES, PRETRAIN_STEPS, pretrain_dirs

CLASSES_BALANCED = ("S", "V")  # spread evenly over folds, rarest first: the classes the issue scores
# what a comparison with a baseline judges (``--figure``): the name, as reports write it
FIGURES = {"macro_f1": "macro-F1", "sv_f1": "S/V F1 (mean of S F1 and V F1)"}


LOG_PREFIX = "[hlmtune cv] "  # every line cv logs starts so (select finds the fold lines by it)


def _say(msg: str) -> None:
    print(f"{LOG_PREFIX}{msg}", file=sys.stderr, flush=True)


def training_pool(db: Path, ds1: Sequence[str], extra_db: Optional[Path]) -> Dict[str, Path]:
    """Every training patient of the cross-validation: record id -> its WFDB files (without extension).

    Without extra patients the ids are DS1's names (``101``), as before svdb; with them every
    id carries its database (``mitdb/101``, ``svdb/800``), so both fold over one pool.
    """
    from hlmtune.ecg_tokenizer.records import list_records

    if extra_db is None:
        return {r: db / r for r in ds1}
    pool = {f"mitdb/{r}": db / r for r in ds1}
    pool.update({f"svdb/{r}": Path(extra_db) / r for r in list_records(Path(extra_db))})
    return pool


def record_class_counts(db: Any, records: Sequence[str]) -> Dict[str, Dict[str, int]]:
    """AAMI class counts of each record's beat annotations (``.atr``).

    Args:
        db (Any): the records' folder, or a mapping record id -> WFDB files without extension
            (:func:`training_pool`).
        records (Sequence[str]): the records.

    Raises:
        FileNotFoundError: a record has no ``.atr`` file (cross-validation needs the labels).
    """
    from hlmtune.ecg_tokenizer.annotations import read_mit_annotations
    from hlmtune.ecg_tokenizer.labels import AAMI_MAP

    out = {}
    for r in records:
        base = db[r] if isinstance(db, dict) else Path(db) / r
        path = base.with_name(base.name + ".atr")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no beat annotations; cross-validation needs every training record's labels")
        ann = read_mit_annotations(path)
        if ann is None:  # a construct the fast reader leaves to wfdb
            import wfdb

            ann = wfdb.rdann(str(base), "atr")
        counts = Counter(AAMI_MAP[s] for s in ann.symbol if s in AAMI_MAP)
        out[r] = {c: int(counts.get(c, 0)) for c in ("N", "S", "V", "F", "Q")}
    return out


def per_database(truth: Sequence[int], pred: Sequence[int], records: Sequence[str],
                 classes: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """The pooled figures of each database's patients alone (``mitdb``, ``svdb``; bare ids: ``DS1``)."""
    from hlmtune.ecg_tokenizer.splits import database_of
    from hlmtune.hlm.evaluate import confusion_matrix, summarize

    groups: Dict[str, List[int]] = {}
    for k, r in enumerate(records):
        groups.setdefault(database_of(str(r)) or "DS1", []).append(k)
    out = {}
    for name, ks in sorted(groups.items()):
        m = confusion_matrix([truth[k] for k in ks], [pred[k] for k in ks], len(classes))
        out[name] = {**summarize(m, classes), "confusion": m}
    return out


def check_partition(partition: int) -> int:
    """``partition`` as an int, refused below 1 (``make_folds``; ``hlmtune cv`` asks before any data stage).

    Raises:
        ValueError: naming ``--partition``.
    """
    if int(partition) < 1:
        raise ValueError(f"--partition {partition}: 1 (the default folds) or another partition's number >= 2")
    return int(partition)


def make_folds(counts: Dict[str, Dict[str, int]], k: int, partition: int = 1) -> List[List[str]]:
    """The records in ``k`` folds with S beats, V beats, all beats and records spread evenly.

    Each record is a vector of its shares of the DS1 totals (S, V, beats, 1 record); records go,
    largest share first, to the fold whose load vector has the smallest dot product with theirs,
    the greedy step of minimising the sum of squared fold loads (ties: fewer records, then the
    lower index). Deterministic; one record with most of a class's beats (209 holds 41% of DS1's
    S) necessarily makes its fold heavy in that class.

    ``partition`` 1 is that order. Another partition of the same patients (``hlmtune cv
    --partition P``, to ask whether a result holds when the patients are grouped otherwise) visits
    the records in a random order drawn with seed P, with the same greedy step, so its folds are
    still spread in S, V, beats and records, but group the patients anew (on the 61 training
    patients, partition 2 keeps 105 of partition 1's 435 same-fold pairs together; chance: ~1 in 4).

    Raises:
        ValueError: ``k < 2``, more folds than records, or ``partition < 1``.
    """
    recs = sorted(counts)
    if k < 2 or k > len(recs):
        raise ValueError(f"--folds must be 2..{len(recs)} (the DS1 records), got {k}")
    partition = check_partition(partition)
    dims = [*CLASSES_BALANCED, "beats", "records"]

    def amount(r: str, d: str) -> float:
        return 1.0 if d == "records" else float(sum(counts[r].values()) if d == "beats" else counts[r].get(d, 0))

    total = {d: sum(amount(r, d) for r in recs) or 1.0 for d in dims}
    share = {r: [amount(r, d) / total[d] for d in dims] for r in recs}
    order = (sorted(recs, key=lambda r: (-max(share[r]), r)) if partition == 1
             else [recs[i] for i in np.random.default_rng(partition).permutation(len(recs))])
    folds: List[List[str]] = [[] for _ in range(k)]
    load = [[0.0] * len(dims) for _ in range(k)]
    for r in order:
        j = min(range(k), key=lambda j: (sum(a * b for a, b in zip(share[r], load[j])), len(folds[j]), j))
        folds[j].append(r)
        load[j] = [a + b for a, b in zip(load[j], share[r])]
    return [sorted(f) for f in folds]


def _fold_db(pool: Dict[str, Path], fold_dir: Path, train: Sequence[str], held_out: Sequence[str],
             synthetic: bool) -> Path:
    """A WFDB folder of links to the fold's records with its ``splits.json`` (held-out = DS2).

    A record id with a database (``svdb/800``) is linked under that subfolder, so the fold's
    records keep their ids in its shards.
    """
    from hlmtune.files import atomic_write_text
    from hlmtune.hlm.pipeline import SYNTHETIC_MARK

    d = fold_dir / "db"
    d.mkdir(parents=True, exist_ok=True)
    for r in [*train, *held_out]:
        base = pool[r]
        for src in base.parent.glob(f"{base.name}.*"):
            link = d / r.rsplit("/", 1)[0] / src.name if "/" in r else d / src.name
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() and link.readlink() != src.resolve():
                link.unlink()  # a copied job's link into the original (its synthetic records): its own now
            if not link.exists():
                link.symlink_to(src.resolve())
    if synthetic:
        atomic_write_text(d / SYNTHETIC_MARK, "records written by hlmtune synth-ecg, not real patients\n")
    atomic_write_text(d / "splits.json", json.dumps({"DS1": list(train), "DS2": list(held_out)}, indent=1) + "\n")
    return d


def _pooled(fold_preds: Sequence[np.ndarray], fold_truth: Sequence[np.ndarray], classes: Sequence[str]) -> Dict[str, Any]:
    from hlmtune.hlm.evaluate import confusion_matrix, summarize

    m = confusion_matrix(np.concatenate(fold_truth).tolist(), np.concatenate(fold_preds).tolist(), len(classes))
    r = summarize(m, classes)
    r["confusion"] = m
    return r


def pooled_members(fold_metrics: Sequence[Dict[str, Any]], classes: Sequence[str]) -> List[Dict[str, Any]]:
    """Each ensemble member's predictions pooled over the folds (confusions summed).

    A fold's ``metrics.json`` lists its rows headline first (the ensemble), then the members in
    seed order (``member 1 (lora)``, ``member 2 (lora_seed1)``, ...): member ``m`` of every fold
    is one fine-tuning seed, and pooling it gives that seed's out-of-fold figures, the draw the
    ensemble's figure is to be read against.

    Args:
        fold_metrics (Sequence[Dict]): the folds' ``metrics.json`` documents.
        classes (Sequence[str]): class order of the confusions.

    Returns:
        List[Dict]: per member ``{"name", "confusion", "per_class", "macro_f1", "accuracy", "n"}``;
        empty when a fold has no members (one seed) or the folds list different members.
    """
    from hlmtune.hlm.evaluate import ordered_results, summarize

    results = [ordered_results(m) for m in fold_metrics]
    names = [list(r)[1:] for r in results]
    if not names or not names[0] or any(n != names[0] for n in names):
        return []
    out = []
    for name in names[0]:
        conf = np.sum([np.asarray(r[name]["confusion"], np.int64) for r in results], axis=0)
        r = summarize(conf.tolist(), classes)
        out.append({"name": name, "confusion": conf.tolist(), **r})
    return out


def fold_folder(out: Path, fold: int) -> Path:
    """The job folder of fold ``fold`` (1-based, as the rows of ``cv_metrics.json`` number them)."""
    return out / f"fold{fold}"


def pretrain_fingerprints(fold_dir: Path, pretrainings: int) -> Optional[List[str]]:
    """Name each pretrained model of a fold by its content: what its fine-tunes start from.

    Args:
        fold_dir (Path): one fold's job folder (``<cv>/fold<k>``).
        pretrainings (int): the fold's pretrained models (``hlmtune cv --pretrainings``).

    Returns:
        Optional[List[str]]: per pretraining, the first 16 hex digits of a SHA-256 over the
        names and bytes of its ``epoch_0`` files (the checkpoint the fine-tunes load); None when
        a pretraining has no such files (not run, or the folder was not kept).
    """
    out = []
    for run in pretrain_dirs(fold_dir, pretrainings):
        files = sorted(f for f in (run / "epoch_0").glob("*") if f.is_file())
        if not files:
            return None
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0")
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        out.append(h.hexdigest()[:16])
    return out


def same_pretraining(row: Dict[str, Any], base_row: Dict[str, Any]) -> Optional[bool]:
    """Whether two fold rows name the same pretrained models; None when either names none."""
    if row.get("pretrain_sha256") is None or base_row.get("pretrain_sha256") is None:
        return None
    return row["pretrain_sha256"] == base_row["pretrain_sha256"]


def figure_of(row: Dict[str, Any], figure: str) -> Optional[float]:
    """The figure ``figure`` (a key of :data:`FIGURES`) of a fold row or a pooled result.

    Args:
        row (Dict): ``macro_f1`` and ``per_class`` (class -> ``{"f1": ...}``), as a cv fold row,
            ``pooled`` or a member has them.
        figure (str): ``macro_f1``, or ``sv_f1``: (S F1 + V F1) / 2.

    Returns:
        Optional[float]: the figure; None when the row lacks a class it needs (or its F1 is None,
        a class neither present nor predicted).

    Raises:
        ValueError: an unknown figure (naming the known ones).
    """
    if figure == "macro_f1":
        return row["macro_f1"]
    if figure != "sv_f1":
        raise ValueError(f"--figure {figure!r}: known figures are {', '.join(FIGURES)}")
    f1 = [(row.get("per_class") or {}).get(c, {}).get("f1") for c in ("S", "V")]
    return None if None in f1 else (f1[0] + f1[1]) / 2


def _figure_pair(a: Dict[str, Any], b: Dict[str, Any], figure: str, where: str) -> Dict[str, float]:
    """``figure_this`` / ``figure_baseline`` / ``figure_delta`` of a row beside its baseline's."""
    x, y = figure_of(a, figure), figure_of(b, figure)
    if x is None or y is None:
        raise ValueError(f"{where}: no {FIGURES[figure]} ({'this run' if x is None else 'the baseline'} has no "
                         "S or V F1 there): judge it by --figure macro_f1")
    return {"figure_this": x, "figure_baseline": y, "figure_delta": x - y}


def compare_to_baseline(doc: Dict[str, Any], base: Dict[str, Any], source: str, *,
                        figure: str = "macro_f1") -> Dict[str, Any]:
    """This run's figures beside a baseline run's (both ``cv_metrics.json`` documents).

    Args:
        doc (Dict): this run's document (``folds``, ``pooled``, optional ``pooled_members``).
        base (Dict): the baseline's document.
        source (str): where the baseline came from (for the report).
        figure (str): what ``folds_at_or_above`` counts and ``figure_delta`` holds (:data:`FIGURES`).

    Returns:
        Dict: ``figure``; ``folds`` (per fold: this, baseline, delta of macro-F1, the same of
        ``figure`` as ``figure_this`` / ``figure_baseline`` / ``figure_delta``, and
        ``same_pretraining``: True / False when both rows name their pretrained models, else
        None), ``folds_at_or_above`` (by ``figure``), ``pooled`` (this, baseline, delta of
        macro-F1, of ``figure`` and of each class's F1), and the members' mean pooled macro-F1 of
        each run where both have members.

    Raises:
        ValueError: the two runs hold out different records in some fold (not the same folds),
            or a row lacks what ``figure`` needs.
    """
    mine, theirs = doc["folds"], base["folds"]
    check_same_folds([a["held_out"] for a in mine], base, source)
    folds = [{"fold": a["fold"], "macro_f1": a["macro_f1"], "baseline": b["macro_f1"],
              "delta": a["macro_f1"] - b["macro_f1"], **_figure_pair(a, b, figure, f"fold {a['fold']}"),
              "same_pretraining": same_pretraining(a, b)}
             for a, b in zip(mine, theirs)]
    classes = [c for c in doc["classes"] if c in base["pooled"]["per_class"]]
    f1 = lambda r, c: r["per_class"][c]["f1"]  # noqa: E731
    pooled = {"macro_f1": doc["pooled"]["macro_f1"], "baseline": base["pooled"]["macro_f1"],
              "delta": doc["pooled"]["macro_f1"] - base["pooled"]["macro_f1"],
              **_figure_pair(doc["pooled"], base["pooled"], figure, "pooled"),
              "f1": {c: {"this": f1(doc["pooled"], c), "baseline": f1(base["pooled"], c)} for c in classes}}
    out = {"source": source, "figure": figure, "folds": folds,
           "folds_at_or_above": sum(f["figure_delta"] >= 0 for f in folds), "pooled": pooled}
    means = [[m["macro_f1"] for m in d.get("pooled_members", [])] for d in (doc, base)]
    if all(means):
        out["members_mean_macro_f1"] = {"this": float(np.mean(means[0])), "baseline": float(np.mean(means[1]))}
    return out


def check_same_folds(held_out: Sequence[Sequence[str]], base: Dict[str, Any], source: str) -> None:
    """Refuse a baseline whose folds hold out other records (its figures would not be comparable).

    Raises:
        ValueError: naming the first fold that differs (or the fold counts).
    """
    theirs = [b["held_out"] for b in base["folds"]]
    if base.get("partial"):  # an unfinished run (--through-fold): its finished folds must be this run's first
        held_out = list(held_out)[:len(theirs)]
    if len(held_out) != len(theirs):
        raise ValueError(f"--baseline {source}: {len(theirs)} folds, this run has {len(held_out)}: not the same folds")
    for k, (a, b) in enumerate(zip(held_out, theirs), start=1):
        if sorted(a) != sorted(b):
            raise ValueError(f"--baseline {source}: fold {k} holds out {' '.join(b)} there, {' '.join(a)} here: "
                             "not the same folds")


def read_baseline(path: Path, *, partial: bool = False) -> Dict[str, Any]:
    """The ``cv_metrics.json`` of ``path`` (an ``hlmtune cv`` folder, or the file itself).

    Args:
        path (Path): the baseline's folder or result file.
        partial (bool): also take a folder whose run went only part of the way
            (``--through-fold``): its ``cv_partial.json`` when it has no ``cv_metrics.json``; the
            document then has ``partial: True`` and rows for its finished folds only.

    Raises:
        FileNotFoundError: no such file (naming it).
        ValueError: not a cross-validation document.
    """
    f = path / "cv_metrics.json" if path.is_dir() else path
    if partial and path.is_dir() and not f.is_file() and (path / PARTIAL).is_file():
        f = path / PARTIAL
    if not f.is_file():
        raise FileNotFoundError(f"--baseline {path}: no cv_metrics.json (give an `hlmtune cv --out` folder)")
    try:
        doc = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--baseline {f}: not JSON ({e})") from None
    if isinstance(doc, dict) and f.name == PARTIAL and doc.get("partial") is True and isinstance(doc.get("folds"), list):
        return doc
    if not isinstance(doc, dict) or not all(k in doc for k in ("folds", "pooled", "classes")):
        raise ValueError(f"--baseline {f}: not an `hlmtune cv` result (needs folds, pooled, classes)")
    for row in doc["folds"]:  # written before rows named them: the folder's checkpoints still can
        if isinstance(row, dict) and "fold" in row and row.get("pretrain_sha256") is None:
            row["pretrain_sha256"] = pretrain_fingerprints(fold_folder(f.parent, row["fold"]), doc.get("pretrainings", 1))
    return doc


def baseline_lines(cmp: Dict[str, Any]) -> List[str]:
    """Markdown section of :func:`compare_to_baseline`."""
    d = lambda v: f"{v:+.3f}"  # noqa: E731
    p = cmp["pooled"]
    lines = [
        f"## Against the baseline `{cmp['source']}`",
        "",
        "| | this run | baseline | difference |",
        "|---|---|---|---|",
        *[f"| fold {f['fold']} macro-F1 | {f['macro_f1']:.3f} | {f['baseline']:.3f} | {d(f['delta'])} |"
          for f in cmp["folds"]],
        f"| **pooled macro-F1** | **{p['macro_f1']:.3f}** | **{p['baseline']:.3f}** | **{d(p['delta'])}** |",
        *[f"| pooled {c} F1 | {v['this']:.3f} | {v['baseline']:.3f} | {d(v['this'] - v['baseline'])} |"
          for c, v in p["f1"].items() if v["this"] is not None and v["baseline"] is not None],
    ]
    if "members_mean_macro_f1" in cmp:
        m = cmp["members_mean_macro_f1"]
        lines.append(f"| members' mean pooled macro-F1 | {m['this']:.3f} | {m['baseline']:.3f} | "
                     f"{d(m['this'] - m['baseline'])} |")
    figure = cmp.get("figure", "macro_f1")
    if figure != "macro_f1":
        lines += [f"| fold {f['fold']} {figure} | {f['figure_this']:.3f} | {f['figure_baseline']:.3f} | "
                  f"{d(f['figure_delta'])} |" for f in cmp["folds"]]
        lines.append(f"| **pooled {figure}** | **{p['figure_this']:.3f}** | **{p['figure_baseline']:.3f}** | "
                     f"**{d(p['figure_delta'])}** |")
    lines += ["", f"Folds at or above the baseline by {FIGURES[figure]}: {cmp['folds_at_or_above']} of "
              f"{len(cmp['folds'])}.", "", pretraining_sentence(cmp), ""]
    return lines


def pretraining_summary(cmp: Dict[str, Any]) -> str:
    """One phrase for stdout: in how many folds the pretrained models are the baseline's."""
    flags = [f.get("same_pretraining") for f in cmp["folds"]]
    n_unknown = sum(v is None for v in flags)
    return (f"same pretrained models in {sum(v is True for v in flags)} of {len(flags)} folds"
            + (f" ({n_unknown} unknown)" if n_unknown else ""))


def pretraining_sentence(cmp: Dict[str, Any]) -> str:
    """Whether the baseline's folds started from the same pretrained models as this run's."""
    flags = [f.get("same_pretraining") for f in cmp["folds"]]
    differ = [str(f["fold"]) for f in cmp["folds"] if f.get("same_pretraining") is False]
    unknown = [str(f["fold"]) for f in cmp["folds"] if f.get("same_pretraining") is None]
    if differ:
        return (f"**Pretrained models differ from the baseline's in fold(s) {', '.join(differ)}**: there the "
                "differences above mix the setting with another pretraining (one redone by code that sums in "
                "another order moved the shipped settings' pooled macro-F1 by 0.011: docs/hlm.md).")
    if unknown:
        return (f"Pretrained models: not known to be the baseline's in fold(s) {', '.join(unknown)} (a row "
                "without `pretrain_sha256` and no checkpoint beside it).")
    return (f"Pretrained models: the baseline's in all {len(flags)} folds (same checkpoint bytes), so the "
            "differences above come from the fine-tunes.")


def _check_overrides(overrides: Sequence[str]) -> None:
    """Refuse a fine-tuning override ``ecg_lora`` does not take before any fold trains.

    Raises:
        ValueError: naming the bad key (and the closest known one).
    """
    if not overrides:
        return
    from hlmtune.compat import load_config
    from hlmtune.registry import resolve_config
    from hlmtune.training.schema import ConfigError, validate_config

    try:
        validate_config(load_config(str(resolve_config("ecg_lora")), list(overrides)), "lora_finetune_distributed")
    except ConfigError as e:
        raise ValueError("fine-tuning overrides: " + "; ".join(e.problems)) from None


def check_arguments(*, out: Path, folds: int, finetune_overrides: Sequence[str],
                    calibrate_classes: Optional[Sequence[str]], baseline: Optional[Path],
                    need_folds: Optional[int], figure: str = "macro_f1",
                    check_pretraining: bool = False, partition: int = 1,
                    through_fold: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """Refuse bad ``hlmtune cv`` input before anything is written; returns the baseline's document.

    Raises:
        ValueError: naming the flag or key (also :func:`read_baseline`'s errors).
    """
    from hlmtune.ecg_tokenizer.labels import AAMI_CLASSES

    _check_overrides(finetune_overrides)
    check_partition(partition)
    if calibrate_classes and not set(calibrate_classes) <= set(AAMI_CLASSES):
        raise ValueError(f"--calibrate-classes: AAMI classes are {' '.join(AAMI_CLASSES)}, got {' '.join(calibrate_classes)}")
    if need_folds is not None and baseline is None:
        raise ValueError("--need-folds counts folds at or above a baseline: give --baseline DIR")
    if need_folds is not None and not 1 <= need_folds <= folds:
        raise ValueError(f"--need-folds {need_folds}: between 1 and --folds ({folds})")
    if figure not in FIGURES:
        raise ValueError(f"--figure {figure!r}: known figures are {', '.join(FIGURES)}")
    if figure != "macro_f1" and baseline is None:
        raise ValueError(f"--figure {figure} is what a comparison with a baseline judges: give --baseline DIR")
    if check_pretraining and baseline is None:
        raise ValueError("--check-pretraining compares fold 1's pretrained model with a baseline's: give --baseline DIR")
    if check_pretraining and need_folds is not None:
        raise ValueError("--check-pretraining fine-tunes nothing, so --need-folds has no folds to count: drop one")
    if through_fold is not None and not 1 <= through_fold <= folds:
        raise ValueError(f"--through-fold {through_fold}: between 1 and --folds ({folds})")
    if through_fold is not None and check_pretraining:
        raise ValueError("--check-pretraining runs fold 1's pretraining only: drop --through-fold")
    base = read_baseline(Path(baseline), partial=need_folds is not None) if baseline is not None else None
    if base is not None and base.get("partial"):
        have = len(base["folds"])
        if base.get("n_folds") != folds:
            raise ValueError(f"--baseline {baseline}: an unfinished run of {base.get('n_folds')} folds, this run has {folds}")
        if through_fold is None or through_fold > have:
            raise ValueError(f"--baseline {baseline}: unfinished, through fold {have} of {folds} ({PARTIAL}): a run "
                             f"beside it goes no further (--through-fold {have} or less), and is judged in full only "
                             "against a finished baseline")
    if baseline is not None and own_result(Path(baseline), out):
        raise ValueError(f"--baseline {baseline}: that is this run's own result, which the run replaces; "
                         f"copy the folder and give the copy as --out (cp -r {out} {out}_b)")
    if check_pretraining and base is not None and not (base["folds"] and base["folds"][0].get("pretrain_sha256")):
        raise ValueError(f"--baseline {baseline}: fold 1 names no pretrained model (no pretrain_sha256, no checkpoint "
                         "beside it): nothing for --check-pretraining to compare")
    for k, row in enumerate(base["folds"] if base is not None and figure != "macro_f1" else (), start=1):
        if not isinstance(row, dict) or figure_of(row, figure) is None:
            raise ValueError(f"--baseline {baseline}: fold {k} has no {FIGURES[figure]} (no S or V F1)")
    return base


def run_cv(
    *, out: Path, data: Optional[str] = None, source: str = "auto", folds: int = 4, nproc: int = 2,
    pretrain_steps: int = PRETRAIN_STEPS, finetune_examples: int = FINETUNE_EXAMPLES, model: str = "hlm_1m", seeds: int = 1,
    max_eval: Optional[int] = None, force: bool = False, finetune_overrides: Sequence[str] = (),
    calibrate_classes: Optional[Sequence[str]] = None, pretrainings: int = 1, baseline: Optional[Path] = None,
    pretrain_seed: int = 0, svdb: Optional[str] = "auto", need_folds: Optional[int] = None,
    figure: str = "macro_f1", check_pretraining: bool = False, partition: int = 1,
    through_fold: Optional[int] = None,
) -> Path:
    """Cross-validate the main job's model over the training patients; returns the report path.

    Args:
        out (Path): work folder (shared tokens, one folder per fold, the pooled report).
        data (Optional[str]): WFDB folder (MIT-BIH, or a database with splits.json: its DS1 is used).
        source (str): where records come from without ``data`` (see ``pipeline.find_data``).
        folds (int): K (2..number of DS1 records).
        nproc (int): CPU ranks of the training stages.
        pretrain_steps (int): pretraining steps per fold (on the fold's training records).
        finetune_examples (int): LoRA examples per fold.
        model (str): ``hlm_1m``, ``hlm_10m`` or ``hlm_100m``.
        seeds (int): fine-tunes per fold, voting as an ensemble (as ``hlmtune demo --seeds``).
        pretrainings (int): pretrained models per fold (as ``hlmtune demo --pretrainings``).
        pretrain_seed (int): the first pretraining's seed in every fold (as ``hlmtune demo
            --pretrain-seed``): another set of pretrained models, to replicate a comparison.
        max_eval (Optional[int]): predict only the first N held-out beats of each fold (smoke runs).
        force (bool): redo finished stages.
        finetune_overrides (Sequence[str]): ``key=value`` overrides of every fold's fine-tune.
        calibrate_classes (Optional[Sequence[str]]): the classes whose F1 the calibration
            maximises and whose bias it moves (default: all); e.g. N S V, leaving F (in MIT-BIH
            DS1 almost all one patient's, record 208) at 0.
        baseline (Optional[Path]): an earlier ``hlmtune cv`` folder (or its ``cv_metrics.json``)
            with the same folds: the report and ``cv_metrics.json`` put this run beside it
            (:func:`compare_to_baseline`). Read before any fold trains.
        need_folds (Optional[int]): with ``baseline``: stop after the fold that leaves fewer than
            this many folds able to end at or above the baseline's macro-F1
            (:func:`rejected_by_folds`), writing ``cv_stopped.json`` and a report that says so.
        figure (str): with ``baseline``: what the fold count and the pooled difference judge
            (:data:`FIGURES`: ``macro_f1``, or ``sv_f1``, the mean of S and V F1).
        svdb (Optional[str]): extra training patients of every fold (``auto``: ``$HLM_DATA/svdb``
            with MIT-BIH data; a folder; None / ``none``), as ``hlmtune demo --svdb``; never held out.
        check_pretraining (bool): with ``baseline``: only fold 1's stages up to its first
            pretrained model, compared with the baseline's (:func:`check_fold1_pretraining`);
            returns ``pretrain_check.json``'s path instead of a report.
        partition (int): the grouping of the patients into folds (:func:`make_folds`; 1: the default).
        through_fold (Optional[int]): run folds 1..K only and write ``cv_partial.json`` (their
            rows, no pooled figures; :func:`write_partial`), whose path is returned; K = ``folds``
            is a whole run. With an unfinished baseline (``need_folds`` required) K may not pass
            the baseline's last finished fold.
    """
    from hlmtune.files import ensure_dir

    base = check_arguments(out=Path(out), folds=folds, finetune_overrides=finetune_overrides, calibrate_classes=calibrate_classes,
                           baseline=baseline, need_folds=need_folds, figure=figure, check_pretraining=check_pretraining, partition=partition,
                           through_fold=through_fold)
    out = ensure_dir(out, "--out").resolve()
    t0 = time.perf_counter()
    setup = cv_setup(out, data=data, source=source, svdb=svdb, folds=folds, base=base, baseline=baseline, partition=partition)
    clear_summaries(out)  # the input is checked: from here the folds run
    job = dict(nproc=nproc, pretrain_steps=pretrain_steps, finetune_examples=finetune_examples, model=model,
               seeds=seeds, pretrainings=pretrainings, pretrain_seed=pretrain_seed, max_eval=max_eval, force=force,
               finetune_overrides=finetune_overrides)
    if check_pretraining:
        return check_fold1_pretraining(setup, out, base, source=str(baseline), t0=t0, **job)
    res = run_folds(setup, out, base_rows=None if base is None else base["folds"], figure=figure, need=need_folds,
                    through=through_fold, **job)
    if res.stopped_after is not None:
        return write_stopped(out, res, base, source=str(baseline), need_folds=need_folds, figure=figure,
                             described=setup.described, wall_s=time.perf_counter() - t0,
                             finetune_overrides=finetune_overrides)
    if len(res.rows) < folds:
        return write_partial(out, res, folds=folds, partition=partition, pretrainings=pretrainings, seeds=seeds,
                             described=setup.described, finetune_overrides=finetune_overrides)
    return _write_whole(out, res, setup, t0=t0, base=base, baseline=baseline, figure=figure, folds=folds,
                        partition=partition, seeds=seeds, pretrainings=pretrainings, pretrain_seed=pretrain_seed,
                        finetune_examples=finetune_examples, model=model, finetune_overrides=finetune_overrides,
                        calibrate_classes=calibrate_classes)


def _write_whole(out: Path, res: "FoldResults", setup: "CVSetup", *, t0: float, base: Optional[Dict[str, Any]],
                 baseline: Optional[Path], figure: str, folds: int, partition: int, seeds: int, pretrainings: int,
                 pretrain_seed: int, finetune_examples: int, model: str, finetune_overrides: Sequence[str],
                 calibrate_classes: Optional[Sequence[str]]) -> Path:
    """Stage 3 of a whole run: pooled figures, ``calibration.json``, ``cv_metrics.json`` and the report."""
    from hlmtune.hlm import calibrate
    from hlmtune.hlm.pipeline import examples_trained

    summary = {
        # "n_folds": the count; cv_metrics.json's "folds" is the per-fold rows (a "folds" here overwrote them)
        "n_folds": folds, "partition": partition, "seeds": seeds, "pretrainings": pretrainings, "pretrain_seed": pretrain_seed,
        "finetune_examples": examples_trained(finetune_examples, finetune_overrides), "model": model,
        "finetune_overrides": list(finetune_overrides),
        "calibrate_classes": list(calibrate_classes) if calibrate_classes else list(res.classes),
    }
    doc, bias = pooled_document(res, setup.described, summary=summary, calibrate_classes=calibrate_classes,
                                wall_s=time.perf_counter() - t0)
    calibrate.write_calibration(out / "calibration.json", classes=res.classes, bias=bias, records=list(setup.pool),
                                source=f"hlmtune cv: out-of-fold predictions of {folds}-fold CV on {setup.described}",
                                summary={k: doc[k] for k in (*summary, "cv_macro_f1_uncalibrated",
                                                             "cv_macro_f1_nested_calibration",
                                                             "cv_macro_f1_fitted_in_sample")})
    return write_results(out, doc, res, base=base, baseline=baseline, figure=figure)


def check_fold1_pretraining(setup: "CVSetup", out: Path, base: Dict[str, Any], *, source: str, t0: float,
                            **job: Any) -> Path:
    """Fold 1's stages up to its first pretrained model, and whether it has the baseline's bytes.

    Equal bytes after hundreds of optimizer steps mean this host sums as the baseline's did (the
    same settings on an Intel and an AMD host gave other bytes and moved a fold's macro-F1 by
    0.049: docs/hlm-experiments.md). One pretraining is the check: the fine-tunes run the same
    kernels. Writes ``pretrain_check.json`` (``same``: the verdict; both digests; this CPU, the
    instruction set of its kernels and the variables that held them,
    :data:`hlmtune.training.fastpath.AVX2_KERNELS_ENV`) and
    returns its path; no fine-tune, no ``cv_metrics.json``.
    """
    import os

    from hlmtune.files import atomic_write_bytes
    from hlmtune.training.fastpath import cpu_model_name, kernel_isa, kernel_settings

    held = setup.parts[0]
    kernels_env = kernel_settings(os.environ)  # what holds the kernels, if anything
    # A check under other kernel settings pretrains again: the stage's stamp (command, data) would keep
    # the model the other kernels made, and answer for them. CHECK_KERNELS says which made the kept one
    # (not a summary: a rerun clears pretrain_check.json before it gets here).
    made = out / CHECK_KERNELS
    before = json.loads(made.read_text()) if made.exists() else {}
    fold_dir = run_fold(setup, out, 0, note="; pretraining only (--check-pretraining)", pretrain_only=True,
                        **{**job, "pretrainings": 1, **({"force": True} if before != kernels_env else {})})
    atomic_write_bytes(made, (json.dumps(kernels_env) + "\n").encode())
    mine = (pretrain_fingerprints(fold_dir, 1) or [None])[0]
    theirs = base["folds"][0]["pretrain_sha256"][0]
    doc = {"baseline": source, "fold": 1, "held_out": held, "pretrain_sha256": mine,
           "baseline_pretrain_sha256": theirs, "same": mine is not None and mine == theirs,
           "cpu": cpu_model_name(), "kernels": kernel_isa(),
           "kernels_env": kernels_env, "wall_s": time.perf_counter() - t0}
    path = out / "pretrain_check.json"
    atomic_write_bytes(path, (json.dumps(doc, indent=1) + "\n").encode())
    return path


def other_bytes_hint(check: Dict[str, Any]) -> str:
    """What to try before re-making a baseline, when ``pretrain_check.json`` says other bytes.

    A host running AVX-512 kernels may compute as the AVX2 host that made the baseline once its
    kernels are held to AVX2 (:data:`hlmtune.training.fastpath.AVX2_KERNELS_ENV`): one more check
    of minutes instead of a re-made cross-validation of hours. Empty when the bytes were the same
    or the check ran without AVX-512 kernels.
    """
    from hlmtune.training.fastpath import AVX2_KERNELS_ENV

    if check.get("same") or not str(check.get("kernels", "")).upper().startswith("AVX512"):
        return ""
    env = " ".join(f"{k}={v}" for k, v in AVX2_KERNELS_ENV.items())
    return (f" (this host ran {check['kernels']} kernels: a baseline made on an AVX2 host may come back with "
            f"{env} in the environment or the plan's env, as on an AMD EPYC in docs/hlm.md; a check under other "
            "kernel settings is asked again, minutes against the hours of a re-made baseline)")


def write_results(out: Path, doc: Dict[str, Any], res: "FoldResults", *, base: Optional[Dict[str, Any]],
                  baseline: Optional[Path], figure: str) -> Path:
    """Stage 4 of a finished run: ``cv_metrics.json`` (``doc``, with the members pooled seed by seed
    and, given a baseline, :func:`compare_to_baseline` by ``figure``) and ``report.md``; returns the report."""
    from hlmtune.files import atomic_write_bytes, atomic_write_text
    from hlmtune.hlm.report import cv_report_markdown

    members = pooled_members(res.metrics, res.classes)
    if members:
        doc["pooled_members"] = members
    cmp = compare_to_baseline(doc, base, str(baseline), figure=figure) if base is not None else None
    if cmp is not None:
        doc["baseline"] = cmp
    atomic_write_bytes(out / "cv_metrics.json", (json.dumps(doc, indent=1) + "\n").encode())
    atomic_write_text(out / "report.md", cv_report_markdown(doc, members=members, baseline=baseline_lines(cmp) if cmp is not None else []))
    return out / "report.md"


def pooled_document(res: "FoldResults", described: str, *, summary: Dict[str, Any],
                    calibrate_classes: Optional[Sequence[str]], wall_s: float) -> Tuple[Dict[str, Any], np.ndarray]:
    """``cv_metrics.json``'s content (before the members and the baseline join it) and the class bias."""
    doc, bias = pool_folds(res, calibrate_classes=calibrate_classes)
    return {"data": described, "classes": res.classes, "folds": res.rows, **doc, **summary,
            "cv_macro_f1_uncalibrated": doc["pooled"]["macro_f1"],
            "cv_macro_f1_nested_calibration": doc["pooled_nested_calibration"]["macro_f1"],
            "cv_macro_f1_fitted_in_sample": doc["pooled_fitted_in_sample"]["macro_f1"],
            "wall_s": wall_s}, bias


PARTIAL = "cv_partial.json"  # the rows of the folds a --through-fold run finished (never pooled figures)
CHECK_KERNELS = "check_kernels.json"  # --check-pretraining: the kernel settings its kept fold-1 pretraining ran under
SUMMARIES = ("cv_metrics.json", "cv_stopped.json", PARTIAL, "report.md", "calibration.json", "pretrain_check.json")


def clear_summaries(out: Path) -> None:
    """Remove the job-level results an earlier run (or the baseline folder this one was copied
    from) left in ``out``: until this run writes its own, none may look like this run's. The
    folds' stages stay (they are what a rerun resumes from); these files are made from them."""
    for name in SUMMARIES:
        (out / name).unlink(missing_ok=True)


def own_result(baseline: Path, out: Path) -> bool:
    """Whether ``baseline`` names ``out`` itself or its ``cv_metrics.json`` (which the run clears)."""
    b, o = baseline.resolve(), out.resolve()
    return b == o or b == o / "cv_metrics.json"


def fold_progress(row: Dict[str, Any], n_folds: int, *, base_row: Optional[Dict[str, Any]] = None,
                  figure: str = "macro_f1", deltas: Sequence[float] = ()) -> str:
    """The log line of a finished fold: its figures and, beside a baseline, how it compares so far.

    A candidate runs for hours; this line is what a watcher of the log reads between folds (the
    pooled figures come only when every fold is done).

    Args:
        row (Dict): the fold's row (``fold``, ``macro_f1``, ``per_class``), as :func:`run_folds` builds it.
        n_folds (int): K, all folds of the run.
        base_row (Optional[Dict]): the baseline's row of the same fold; None without a baseline.
        figure (str): the figure judged (a key of :data:`FIGURES`).
        deltas (Sequence[float]): the figure's deltas of every fold finished so far, this one included.

    Returns:
        str: e.g. ``fold 2 of 4 done: S F1 0.579, V F1 0.756, macro-F1 0.575; S/V F1 (mean of S F1
        and V F1) 0.668 vs the baseline's 0.668 (+0.000); 2 of 2 folds so far at or above it``.
    """
    k = row["fold"]
    f1 = [f"{c} F1 {v['f1']:.3f}" for c, v in (row.get("per_class") or {}).items()
          if c in ("S", "V") and v.get("f1") is not None]
    line = f"fold {k} of {n_folds} done: " + ", ".join(f1 + [f"macro-F1 {row['macro_f1']:.3f}"])
    if base_row is None:
        return line
    pair = _figure_pair(row, base_row, figure, f"fold {k}")
    line += (f"; {FIGURES[figure]} {pair['figure_this']:.3f} vs the baseline's {pair['figure_baseline']:.3f} "
             f"({pair['figure_delta']:+.3f})")
    if deltas:
        line += f"; {sum(d >= 0 for d in deltas)} of {len(deltas)} folds so far at or above it"
    return line


def fold_progress_in(line: str) -> Optional[str]:
    """The :func:`fold_progress` message a line of cv's log carries (without the log prefix), else None."""
    msg = line.strip()
    if not msg.startswith(LOG_PREFIX):
        return None
    msg = msg[len(LOG_PREFIX):]
    return msg if msg.startswith("fold ") and " done: " in msg else None


def rejected_by_folds(deltas: Sequence[float], n_folds: int, need: int) -> bool:
    """Whether folds scored so far already rule out ``need`` of ``n_folds`` at or above the baseline.

    Args:
        deltas (Sequence[float]): macro-F1 minus the baseline's, of the folds finished (0 counts as at).
        n_folds (int): K, all folds of the run.
        need (int): folds the rule needs at or above the baseline.

    Returns:
        bool: True once more than ``n_folds - need`` folds are below: the folds still to run cannot
        lift the count to ``need``, so the rule's verdict (rejected) is known.
    """
    return sum(d < 0 for d in deltas) > n_folds - need


def write_stopped(out: Path, res: "FoldResults", base: Dict[str, Any], *, source: str, need_folds: int,
                  described: str, wall_s: float, finetune_overrides: Sequence[str], figure: str = "macro_f1") -> Path:
    """``cv_stopped.json`` and ``report.md`` of a run stopped by ``--need-folds``; returns the report."""
    from hlmtune.files import atomic_write_bytes, atomic_write_text

    k = len(res.rows)
    n = int(base["n_folds"]) if isinstance(base.get("n_folds"), int) else len(base["folds"])  # an unfinished baseline has fewer rows
    folds = [{"fold": r["fold"], "held_out": r["held_out"], "macro_f1": r["macro_f1"], "baseline": b["macro_f1"],
              "delta": r["macro_f1"] - b["macro_f1"], **_figure_pair(r, b, figure, f"fold {r['fold']}"),
              "per_class": r["per_class"], "pretrain_sha256": r["pretrain_sha256"],
              "same_pretraining": same_pretraining(r, b)}
             for r, b in zip(res.rows, base["folds"])]
    below = sum(f["figure_delta"] < 0 for f in folds)
    doc = {"stopped": True, "data": described, "baseline": source, "figure": figure, "need_folds": need_folds,
           "n_folds": n,
           "folds_run": k, "folds_below": below, "finetune_overrides": list(finetune_overrides), "folds": folds,
           "wall_s": wall_s,
           "verdict": f"rejected: {below} of {k} folds below the baseline, so at most {n - below} of {n} can be at or "
                      f"above it (the rule needs {need_folds})"}
    atomic_write_bytes(out / "cv_stopped.json", (json.dumps(doc, indent=1) + "\n").encode())
    lines = [
        f"**STOPPED after fold {k} of {n} (`--need-folds {need_folds}`): not a complete cross-validation.** "
        f"{f'Fold {n} was' if k + 1 == n else f'Folds {k + 1}-{n} were'} not run with these settings; no pooled "
        "figures exist. DS2 was not read.",
        "",
        f"# HLM cross-validation against `{source}`: {doc['verdict']}",
        "",
        f"Data: {described}." + (f" Overrides: `{' '.join(finetune_overrides)}`." if finetune_overrides else ""),
        "",
        f"| fold | {FIGURES[figure]} | baseline | difference |",
        "|---|---|---|---|",
        *[f"| {f['fold']} | {f['figure_this']:.3f} | {f['figure_baseline']:.3f} | {f['figure_delta']:+.3f} |"
          for f in folds],
        "",
        "Rerun without `--need-folds` to run the remaining folds (the finished ones are kept).",
        "",
    ]
    atomic_write_text(out / "report.md", "\n".join(lines))
    return out / "report.md"


def write_partial(out: Path, res: "FoldResults", *, folds: int, partition: int, pretrainings: int, seeds: int,
                  described: str, finetune_overrides: Sequence[str]) -> Path:
    """``cv_partial.json`` of a ``--through-fold`` run: its finished folds' rows; returns its path.

    No pooled figure and no report: an unfinished cross-validation is not a result. A candidate can
    be rejected fold by fold beside it (``--need-folds``), never adopted.
    """
    from hlmtune.files import atomic_write_bytes

    doc = {"partial": True, "through_fold": len(res.rows), "n_folds": folds, "partition": partition,
           "pretrainings": pretrainings, "seeds": seeds, "data": described, "classes": res.classes,
           "finetune_overrides": list(finetune_overrides), "folds": res.rows}
    atomic_write_bytes(out / PARTIAL, (json.dumps(doc, indent=1) + "\n").encode())
    return out / PARTIAL


@dataclass
class CVSetup:
    """The training patients of a cross-validation and their folds.

    Attributes:
        db (Path): the MIT-BIH (or split-file database) folder.
        described (str): the data, as the report names it.
        pool (Dict[str, Path]): record id -> its WFDB files (:func:`training_pool`).
        parts (List[List[str]]): the folds' held-out records.
        synthetic (bool): synthetic records (named so in every report).
        tokens (Path): the tokens every fold shares.
    """

    db: Path
    described: str
    pool: Dict[str, Path]
    parts: List[List[str]]
    synthetic: bool
    tokens: Path

    def train(self, k: int) -> List[str]:
        """Fold ``k``'s training records (0-based ``k``): every record of the pool it does not hold out."""
        return [r for r in self.pool if r not in self.parts[k]]


def cv_setup(out: Path, *, data: Optional[str], source: str, svdb: Optional[str], folds: int,
             base: Optional[Dict[str, Any]], baseline: Optional[Path], partition: int = 1) -> CVSetup:
    """Stage 1: the training patients (DS1, and svdb's when present), their folds (``folds.json``).

    A baseline of other folds is refused here, before any fold trains.
    """
    from hlmtune.files import atomic_write_text
    from hlmtune.ecg_tokenizer.splits import load_split_file
    from hlmtune.hlm.pipeline import SYNTHETIC_MARK, find_data, find_svdb

    db, described, split_file = find_data(data, out, source)
    if split_file is None and (db / "splits.json").exists():
        split_file = db / "splits.json"
    ds1 = list(load_split_file(str(split_file) if split_file else None)["DS1"])  # refuses DS1/DS2 overlaps
    extra_db = find_svdb(svdb, mitdb=split_file is None)  # its patients fold beside DS1's
    pool = training_pool(db, ds1, extra_db)
    counts = record_class_counts(pool, list(pool))
    parts = make_folds(counts, folds, partition)
    if base is not None:
        check_same_folds(parts, base, str(baseline))
    if extra_db is not None:
        described += f" + MIT-BIH Supraventricular ({extra_db}, {len(pool) - len(ds1)} records)"
    grouping = "" if partition == 1 else f" (partition {partition})"
    _say(f"data: {described}; {len(pool)} training records in {folds} folds{grouping}, S beats spread evenly "
         "(DS2 is not read)")
    atomic_write_text(out / "folds.json", json.dumps({"folds": parts, "counts": counts, "partition": partition},
                                                     indent=1) + "\n")
    # one tokenization of the training records serves every fold
    return CVSetup(db, described, pool, parts, (db / SYNTHETIC_MARK).exists(), out / "tokens")


@dataclass
class FoldResults:
    """Every fold's held-out predictions (its result row: the run, or its seeds' ensemble; never calibrated)."""

    classes: List[str] = field(default_factory=list)
    truth: List[np.ndarray] = field(default_factory=list)
    logprobs: List[np.ndarray] = field(default_factory=list)
    records: List[Optional[np.ndarray]] = field(default_factory=list)  # None: predictions.npz of an older version
    ratios: List[Optional[np.ndarray]] = field(default_factory=list)
    rows: List[Dict[str, Any]] = field(default_factory=list)
    metrics: List[Dict[str, Any]] = field(default_factory=list)
    stopped_after: Optional[int] = None  # the fold after which ``--need-folds`` stopped the run


def run_fold(setup: CVSetup, out: Path, k: int, *, note: str = "", **job: Any) -> Path:
    """The main job's stages on fold ``k`` (0-based: its held-out patients as the test split);
    returns what ``run_pipeline`` returns (the report, or the fold's folder with ``pretrain_only``)."""
    from hlmtune.hlm.pipeline import run_pipeline

    held = setup.parts[k]
    fold_dir = fold_folder(out, k + 1)
    _say(f"fold {k + 1} of {len(setup.parts)}: holding out {' '.join(held)}{note}")
    return run_pipeline(out=fold_dir, data=str(_fold_db(setup.pool, fold_dir, setup.train(k), held, setup.synthetic)),
                        tokens_dir=setup.tokens, svdb=None, job_root=out, **job)


def run_folds(setup: CVSetup, out: Path, *, base_rows: Optional[Sequence[Dict[str, Any]]] = None,
              figure: str = "macro_f1", need: Optional[int] = None, through: Optional[int] = None,
              **job: Any) -> FoldResults:
    """Stage 2: the main job's stages on each fold (its held-out patients as the test split).

    Each fold's figures are logged as it ends (:func:`fold_progress`), beside ``base_rows`` (the
    baseline's fold rows, judged by ``figure``, a key of :data:`FIGURES`) when given. ``need``
    (folds needed at or above the baseline; with ``base_rows``): the folds end as soon as
    :func:`rejected_by_folds` says the rest cannot change the verdict. ``through``: the folds end
    after fold ``through`` (``--through-fold``)."""
    from hlmtune.hlm.evaluate import headline

    res = FoldResults()
    deltas: List[float] = []
    for k, held in enumerate(setup.parts[:through]):
        report = run_fold(setup, out, k, **job)
        pred = np.load(report.parent / "predictions.npz")
        res.classes = [str(c) for c in pred["classes"]]
        res.truth.append(pred["truth"])
        res.logprobs.append(pred["logprobs"][0])
        res.records.append(pred["record"] if "record" in pred.files else None)
        res.ratios.append(pred["rr_ratio"] if "rr_ratio" in pred.files else None)
        metrics = json.loads((report.parent / "metrics.json").read_text())
        res.metrics.append(metrics)
        r = headline(metrics)
        row = {"fold": k + 1, "held_out": held, "train": setup.train(k),
               "n": r["n"], "macro_f1": r["macro_f1"], "per_class": r["per_class"],
               "pretrain_sha256": pretrain_fingerprints(fold_folder(out, k + 1), int(job["pretrainings"]))}
        res.rows.append(row)
        if base_rows is None:
            _say(fold_progress(row, len(setup.parts)))
            continue
        deltas.append(_figure_pair(row, base_rows[k], figure, f"fold {k + 1}")["figure_delta"])
        _say(fold_progress(row, len(setup.parts), base_row=base_rows[k], figure=figure, deltas=deltas))
        if need is not None and k + 1 < len(setup.parts) and rejected_by_folds(deltas, len(setup.parts), need):
            _say(f"stopping after fold {k + 1}: {sum(d < 0 for d in deltas)} folds below the baseline, "
                 f"so fewer than {need} of {len(setup.parts)} can end at or above it (--need-folds)")
            res.stopped_after = k + 1
            break
    return res


def pool_folds(res: FoldResults, *, calibrate_classes: Optional[Sequence[str]]) -> Tuple[Dict[str, Any], np.ndarray]:
    """Stage 3: pooled out-of-fold figures (per record, per database, by timing), the class bias
    fitted on them and its nested estimate; returns (those figures, the bias)."""
    from hlmtune.hlm import calibrate
    from hlmtune.hlm.evaluate import by_timing, per_record

    classes = res.classes
    unknown = sorted(set(calibrate_classes or ()) - set(classes))
    if unknown:
        raise ValueError(f"--calibrate-classes {' '.join(unknown)}: not among the run's classes {' '.join(classes)}")
    scored = [classes.index(c) for c in calibrate_classes] if calibrate_classes else None
    fold_pred = [lp.argmax(1) for lp in res.logprobs]
    pooled = _pooled(fold_pred, res.truth, classes)
    truth, pred = np.concatenate(res.truth).tolist(), np.concatenate(fold_pred).tolist()
    if all(r is not None for r in res.records):
        records = np.concatenate(res.records).tolist()
        pooled["per_record"] = per_record(truth, pred, records, classes)
        pooled["per_database"] = per_database(truth, pred, records, classes)
    if all(r is not None for r in res.ratios):
        pooled["by_timing"] = by_timing(truth, pred, np.concatenate(res.ratios).astype(float).tolist(), classes)
    nested = _pooled(calibrate.nested_predictions(list(zip(res.logprobs, res.truth)), scored=scored), res.truth, classes)
    bias = calibrate.fit_class_bias(np.concatenate(res.logprobs), np.concatenate(res.truth), scored=scored)
    fitted = _pooled([calibrate.apply_bias(lp, bias) for lp in res.logprobs], res.truth, classes)
    return {"pooled": pooled, "pooled_nested_calibration": nested, "pooled_fitted_in_sample": fitted,
            "class_bias": dict(zip(classes, map(float, bias)))}, bias


def register(subparsers: Any) -> None:
    """Add ``hlmtune cv``."""
    p = subparsers.add_parser(
        "cv",
        help="patient-wise K-fold cross-validation over the training patients (model selection without DS2) + "
             "class-bias calibration",
        description=textwrap.fill(
            "Split the training patients (DS1, + svdb when present) into K folds (S and V beats spread evenly), run the main job's stages per fold "
            "(pretrain on the fold's training records, LoRA fine-tune, predict the held-out patients), pool the "
            "out-of-fold predictions (per fold, pooled, per record and by the beat's timing), and write report.md, cv_metrics.json and "
            "calibration.json (a per-class bias "
            "on the class log-probabilities fitted for macro-F1, for `hlmtune eval --calibration`). DS2 is never "
            "read. Fine-tuning overrides after the flags apply to every fold (e.g. dataset.next_rr=False)."
        ),
        epilog=(
            "examples (MIT-BIH from $HLM_DATA/mitdb and svdb beside it; about 85 min on 2 CPU cores with --seeds 3):\n"
            "  hlmtune cv --out outputs/cv                                  # the shipped settings\n"
            "  hlmtune cv --out outputs/cv dataset.premature_synth=0.2     # same folds and pretrained models,\n"
            "                                                               # new fine-tunes: a setting scored\n"
            "  cp -r outputs/cv outputs/cv_b && hlmtune cv --out outputs/cv_b --baseline outputs/cv \\\n"
            "      dataset.premature_synth=0.2    # the same, keeping outputs/cv's fine-tunes, reported beside them\n"
            "  ... --baseline outputs/cv --need-folds 3 dataset.premature_synth=0.2   # stop once 3 of 4 folds at or\n"
            "                                                               # above the baseline is out of reach\n"
            "  hlmtune cv --out outputs/cv_p1 --pretrain-seed 1            # the same folds, another set of "
            "pretrained models\n"
            "                                                               # (a setting's gain replicated there?)\n"
            "  hlmtune cv --out outputs/cv_part2 --partition 2             # the patients grouped into other folds\n"
            "  hlmtune cv --out /tmp/check --baseline outputs/cv --check-pretraining   # does this host compute as\n"
            "                                                               # the one that made outputs/cv? (one\n"
            "                                                               # pretraining, its checkpoint digest)\n"
            "  hlmtune eval --config RUN --calibration outputs/cv/calibration.json\n"
            "  hlmtune cv --out /tmp/cv --source synthetic --folds 2 --pretrain-steps 4 --finetune-examples 64 "
            "--max-eval 150   # smoke run"
        ),
        formatter_class=RawDefaultsHelpFormatter,
    )
    from hlmtune.hlm.pipeline import add_job_arguments, run_job

    p.add_argument("overrides", nargs="*", help="key=value overrides of every fold's LoRA fine-tune (ecg_lora)")
    p.add_argument("--folds", type=int, default=4, help="K: folds of the training patients (DS1, + svdb when present)")
    p.add_argument("--partition", type=int, default=1, metavar="P",
                   help="which grouping of the patients into the K folds: 1, S-rich patients spread largest first; "
                        "P >= 2 visits them in a random order drawn with seed P (still spread in S, V and beats): "
                        "the same comparison on other folds, to see whether a result holds when the patients are "
                        "grouped otherwise (a baseline must be of the same partition)")
    p.add_argument("--calibrate-classes", nargs="+", default=None, metavar="CLASS",
                   help="classes whose F1 the class bias maximises and whose bias moves (default: all), e.g. "
                        "N S V to leave a class seen in one or two patients at 0")
    p.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                   help="an earlier `hlmtune cv --out` folder with the same folds: the report puts this run beside it "
                        "(per fold, pooled, members' mean), counts the folds at or above it, and names the folds whose "
                        "pretrained models differ from this run's (checkpoint bytes): judge a setting against a "
                        "baseline on the same pretrained models")
    p.add_argument("--need-folds", type=int, default=None, metavar="M",
                   help="with --baseline: stop as soon as fewer than M folds can still end at or above the baseline's "
                        "figure (--figure) (the adoption rule's count, e.g. 3 of 4 in docs/hlm.md): the candidate is rejected "
                        "without its remaining folds; writes cv_stopped.json and a report marked STOPPED (rerun "
                        "without it to finish the folds)")
    p.add_argument("--figure", choices=sorted(FIGURES), default="macro_f1",
                   help="with --baseline: the figure the fold count (and --need-folds) and the pooled difference "
                        "judge: macro-F1 over the classes, or sv_f1, the mean of S F1 and V F1 (not swung by a class "
                        "of a few hundred beats held by one or two folds)")
    p.add_argument("--through-fold", type=int, default=None, metavar="K",
                   help="run folds 1..K only and write cv_partial.json (their rows, no pooled figures); a rerun "
                        "with a larger K goes on from there. A candidate beside an unfinished baseline (--baseline "
                        "with --need-folds) goes no further than the baseline's folds: rejected fold by fold, judged "
                        "in full only against a finished baseline (hlmtune select --interleave alternates the two)")
    p.add_argument("--check-pretraining", action="store_true",
                   help="with --baseline: run fold 1 only up to its first pretrained model and say whether its "
                        "checkpoint bytes are the baseline's (pretrain_check.json): whether this host computes as the "
                        "one that made the baseline, in one pretraining instead of a re-made cross-validation. "
                        "On an AVX-512 host, ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "
                        "MKL_ENABLE_INSTRUCTIONS=AVX2 make it compute as an AVX2 host (docs/hlm.md); a check "
                        "under other kernel settings pretrains again")
    add_job_arguments(p, out="outputs/cv", each=" per fold")
    p.set_defaults(func=lambda args: _main(args, run_job))


def _main(args: argparse.Namespace, run_job: Any) -> int:
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        print(f"hlmtune cv: overrides are key=value, got {bad[0]!r}", file=sys.stderr)
        return 2

    def job() -> Path:
        report = run_cv(out=Path(args.out), data=args.data, source=args.source, folds=args.folds, nproc=args.nproc,
                        pretrain_steps=args.pretrain_steps, finetune_examples=args.finetune_examples,
                        model=args.model, seeds=args.seeds, pretrainings=args.pretrainings, pretrain_seed=args.pretrain_seed,
                        max_eval=args.max_eval, force=args.force,
                        finetune_overrides=args.overrides, calibrate_classes=args.calibrate_classes,
                        baseline=args.baseline, svdb=args.svdb, need_folds=args.need_folds, figure=args.figure,
                        check_pretraining=args.check_pretraining, partition=args.partition,
                        through_fold=args.through_fold)
        from hlmtune.hlm.evaluate import class_table

        if report.name == PARTIAL:
            done = json.loads(report.read_text())
            print(f"folds 1-{done['through_fold']} of {done['n_folds']} finished ({report}); no pooled figures until "
                  f"every fold has run (rerun with a larger --through-fold, or without it)")
            return report

        if report.name == "pretrain_check.json":
            c = json.loads(report.read_text())
            print(f"fold 1's pretrained model: {c['pretrain_sha256']} here ({c['cpu']}), "
                  f"{c['baseline_pretrain_sha256']} in {c['baseline']}: "
                  + ("the same bytes: this host computes as the baseline's did" if c["same"] else
                     "other bytes: this host computes otherwise, so compare runs made here with a baseline "
                     "re-made here" + other_bytes_hint(c)))
            return report

        stopped = report.parent / "cv_stopped.json"
        if stopped.exists():
            print(f"stopped after fold {json.loads(stopped.read_text())['folds_run']} of {args.folds}: "
                  f"{json.loads(stopped.read_text())['verdict']}")
            return report

        doc = json.loads((report.parent / "cv_metrics.json").read_text())
        print(f"pooled out-of-fold predictions, {args.folds} folds of the training patients of {doc['data']} "
              "(not comparable to DS2 figures):")
        print(class_table(doc["pooled"], doc["classes"]))
        print(f"macro-F1 with a class bias fitted on the other folds (nested): "
              f"{doc['cv_macro_f1_nested_calibration']:.3f}")
        if "baseline" in doc:
            cmp = doc["baseline"]
            print(f"against {cmp['source']}: pooled macro-F1 {cmp['pooled']['macro_f1']:.3f} vs "
                  f"{cmp['pooled']['baseline']:.3f} ({cmp['pooled']['delta']:+.3f}); "
                  + (f"pooled {args.figure} {cmp['pooled']['figure_this']:.3f} vs {cmp['pooled']['figure_baseline']:.3f} "
                     f"({cmp['pooled']['figure_delta']:+.3f}); " if args.figure != "macro_f1" else "")
                  + f"folds at or above by {args.figure}: {cmp['folds_at_or_above']} of {len(cmp['folds'])}; "
                  f"{pretraining_summary(cmp)}")
        print(f"calibration: {report.parent / 'calibration.json'}")
        return report

    return run_job("cv", args, job)
