"""`hlmtune cv`: folds by patient, pooled out-of-fold predictions, the calibration it writes, the
members pooled and the comparison with a baseline run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hlmtune.hlm import calibrate as cal
from hlmtune.hlm.cv import (
    baseline_lines, compare_to_baseline, figure_of, fold_progress, fold_progress_in, make_folds, own_result, pooled_members, pretrain_fingerprints,
    FoldResults, other_bytes_hint, pretraining_summary, read_baseline, rejected_by_folds, write_stopped,
)

HLMTUNE = str(Path(sys.executable).with_name("hlmtune"))


def _counts(s=0, v=0, n=1000):
    return {"N": n, "S": s, "V": v, "F": 0, "Q": 0}


def test_folds_partition_the_records_and_spread_the_rare_classes():
    counts = {**{f"s{i}": _counts(s=50) for i in range(4)}, **{f"v{i}": _counts(v=80) for i in range(4)}}
    folds = make_folds(counts, 4)
    assert sorted(r for f in folds for r in f) == sorted(counts)
    # every fold holds one S patient and one V patient
    assert sorted(sorted(r[0] for r in f) for f in folds) == [["s", "v"]] * 4
    assert make_folds(counts, 4) == folds  # deterministic
    rng = np.random.default_rng(0)
    many = {f"r{i:02d}": _counts(s=int(rng.integers(0, 400)), v=int(rng.integers(0, 900)),
                                 n=int(rng.integers(1000, 3000))) for i in range(22)}
    for k in (2, 3, 5):
        folds = make_folds(many, k)
        assert sorted(r for f in folds for r in f) == sorted(many)
        sizes = [len(f) for f in folds]
        assert max(sizes) - min(sizes) <= 2, sizes
        s = [sum(many[r]["S"] for r in f) for f in folds]
        assert max(s) <= 1.5 * sum(s) / k, s
    for k in (1, 23):
        with pytest.raises(ValueError, match="--folds must be 2..22"):
            make_folds(many, k)


def _f1(conf, k):
    """F1 of class k from a confusion (rows true, columns predicted), written out by hand."""
    tp = conf[k][k]
    called = sum(row[k] for row in conf)
    actual = sum(conf[k])
    se, ppv = tp / actual, tp / called
    return 2 * se * ppv / (se + ppv)


def test_members_are_pooled_seed_by_seed_over_the_folds():
    classes = ["N", "S"]
    # rows as metrics.json stores them (sorted keys), the order in row_order: ensemble first
    fold = lambda e, m1, m2: {"row_order": ["ens", "member 1 (lora)", "member 2 (lora_seed1)"], "result": "ens",  # noqa: E731
                              "results": {"ens": {"confusion": e}, "member 2 (lora_seed1)": {"confusion": m2},
                                          "member 1 (lora)": {"confusion": m1}}}
    f1 = fold([[9, 1], [0, 2]], [[8, 2], [1, 1]], [[10, 0], [2, 0]])
    f2 = fold([[5, 0], [1, 3]], [[4, 1], [0, 4]], [[3, 2], [1, 3]])
    got = pooled_members([f1, f2], classes)
    assert [m["name"] for m in got] == ["member 1 (lora)", "member 2 (lora_seed1)"]
    m1 = [[12, 3], [1, 5]]  # fold 1 + fold 2 of member 1
    m2 = [[13, 2], [3, 3]]
    assert got[0]["confusion"] == m1 and got[1]["confusion"] == m2
    for m, conf in zip(got, (m1, m2)):
        assert m["per_class"]["S"]["f1"] == pytest.approx(_f1(conf, 1))
        assert m["macro_f1"] == pytest.approx((_f1(conf, 0) + _f1(conf, 1)) / 2)
        assert m["n"] == 21
    # one seed (no members), or folds listing different members: nothing to pool
    one = {"results": {"HLM (this run)": {"confusion": [[1, 0], [0, 1]]}}}
    assert pooled_members([one, one], classes) == []
    other = fold([[5, 0], [1, 3]], [[4, 1], [0, 4]], [[3, 2], [1, 3]])
    other["results"]["member 3 (lora_seed2)"] = other["results"].pop("member 2 (lora_seed1)")
    other["row_order"][2] = "member 3 (lora_seed2)"
    assert pooled_members([f1, other], classes) == []


def _cv_doc(held, fold_f1, pooled_f1, s_f1, members=None):
    doc = {"classes": ["N", "S"], "folds": [{"fold": k + 1, "held_out": h, "macro_f1": f}
                                            for k, (h, f) in enumerate(zip(held, fold_f1))],
           "pooled": {"macro_f1": pooled_f1, "per_class": {"N": {"f1": 0.9}, "S": {"f1": s_f1}}}}
    if members:
        doc["pooled_members"] = [{"macro_f1": m} for m in members]
    return doc


def test_a_run_is_compared_fold_by_fold_with_its_baseline(tmp_path):
    held = [["101", "102"], ["103"], ["104"]]
    base = _cv_doc(held, [0.6, 0.5, 0.4], 0.55, 0.3, members=[0.50, 0.52, 0.54])
    # folds listed in another order inside a fold: still the same folds
    new = _cv_doc([["102", "101"], ["103"], ["104"]], [0.6, 0.45, 0.41], 0.56, 0.35, members=[0.53, 0.55, 0.57])
    cmp = compare_to_baseline(new, base, "b")
    assert [round(f["delta"], 6) for f in cmp["folds"]] == [0.0, -0.05, 0.01]
    assert cmp["folds_at_or_above"] == 2  # equal counts as at
    assert cmp["pooled"]["delta"] == pytest.approx(0.01) and cmp["pooled"]["f1"]["S"] == {"this": 0.35, "baseline": 0.3}
    assert cmp["members_mean_macro_f1"] == pytest.approx({"this": 0.55, "baseline": 0.52})
    assert "members_mean_macro_f1" not in compare_to_baseline(_cv_doc(held, [0.6, 0.5, 0.4], 0.5, 0.3), base, "b")
    with pytest.raises(ValueError, match="fold 2 holds out 103 there, 105 here"):
        compare_to_baseline(_cv_doc([["101", "102"], ["105"], ["104"]], [0.6, 0.5, 0.4], 0.5, 0.3), base, "b")
    with pytest.raises(ValueError, match="2 folds, this run has 3"):
        compare_to_baseline(new, _cv_doc(held[:2], [0.6, 0.5], 0.5, 0.3), "b")
    # read_baseline: a cv folder or its file; anything else is named
    (tmp_path / "cv").mkdir()
    (tmp_path / "cv" / "cv_metrics.json").write_text(json.dumps(base))
    got = read_baseline(tmp_path / "cv")
    assert got == read_baseline(tmp_path / "cv" / "cv_metrics.json") and got["pooled"] == base["pooled"]
    # rows kept as written, plus pretrained models looked up beside the file (none here)
    assert got["folds"] == [dict(r, pretrain_sha256=None) for r in base["folds"]]
    with pytest.raises(FileNotFoundError, match="nothere: no cv_metrics.json"):
        read_baseline(tmp_path / "nothere")
    (tmp_path / "x.json").write_text('{"folds": []}')
    with pytest.raises(ValueError, match="x.json: not an `hlmtune cv` result"):
        read_baseline(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{")
    with pytest.raises(ValueError, match="y.json: not JSON"):
        read_baseline(tmp_path / "y.json")


def _sv_doc(macro, s, v):
    """A cv document of two folds: per fold (macro-F1, S F1, V F1); pooled the folds' means."""
    row = lambda m, a, b: {"macro_f1": m, "per_class": {"N": {"f1": 0.9}, "S": {"f1": a}, "V": {"f1": b}}}  # noqa: E731
    folds = [dict(row(m, a, b), fold=k + 1, held_out=[f"r{k}"]) for k, (m, a, b) in enumerate(zip(macro, s, v))]
    return {"classes": ["N", "S", "V"], "folds": folds, "pooled": row(sum(macro) / 2, sum(s) / 2, sum(v) / 2)}


def test_a_comparison_by_sv_f1_judges_the_mean_of_s_and_v_f1():
    base = _sv_doc([0.60, 0.60], [0.50, 0.50], [0.80, 0.80])
    # macro-F1 lower in both folds (another class lost), S and V F1 higher in fold 1, lower in fold 2
    new = _sv_doc([0.55, 0.58], [0.60, 0.49], [0.82, 0.79])
    by_macro = compare_to_baseline(new, base, "b")
    assert by_macro["figure"] == "macro_f1" and by_macro["folds_at_or_above"] == 0
    assert [f["figure_delta"] for f in by_macro["folds"]] == [f["delta"] for f in by_macro["folds"]]
    by_sv = compare_to_baseline(new, base, "b", figure="sv_f1")
    assert by_sv["figure"] == "sv_f1" and by_sv["folds_at_or_above"] == 1
    # written out: fold 1 (0.60 + 0.82) / 2 - (0.50 + 0.80) / 2 = +0.06, fold 2 (0.49 + 0.79) / 2 - 0.65 = -0.01
    assert [round(f["figure_delta"], 6) for f in by_sv["folds"]] == [0.06, -0.01]
    assert by_sv["folds"][0]["figure_this"] == pytest.approx(0.71) and by_sv["folds"][0]["figure_baseline"] == 0.65
    assert by_sv["pooled"]["figure_delta"] == pytest.approx(0.025) and by_sv["pooled"]["delta"] == pytest.approx(-0.035)
    text = "\n".join(baseline_lines(by_sv))
    assert "| fold 2 sv_f1 | 0.640 | 0.650 | -0.010 |" in text and "| **pooled sv_f1** | **0.675** | **0.650** |" in text
    assert "Folds at or above the baseline by S/V F1 (mean of S F1 and V F1): 1 of 2." in text
    assert "sv_f1" not in "\n".join(baseline_lines(by_macro))
    del new["folds"][1]["per_class"]["V"]  # a fold without V: no such figure, and no silent zero
    with pytest.raises(ValueError, match="fold 2: no S/V F1 .*this run has no S or V F1"):
        compare_to_baseline(new, base, "b", figure="sv_f1")
    with pytest.raises(ValueError, match="known figures are macro_f1, sv_f1"):
        figure_of(base["pooled"], "s_f1")


def test_a_candidate_is_rejected_as_soon_as_the_fold_count_is_out_of_reach():
    # 3 of 4 needed: one fold below leaves 3 possible; two below leave 2
    assert not rejected_by_folds([-0.01], 4, 3)
    assert not rejected_by_folds([-0.01, 0.0], 4, 3)  # equal counts as at
    assert rejected_by_folds([-0.01, -0.002], 4, 3)
    assert rejected_by_folds([0.02, -0.01, -0.001], 4, 3)
    assert rejected_by_folds([-1e-9], 4, 4) and not rejected_by_folds([0.0, 0.0, 0.0], 4, 4)
    assert not rejected_by_folds([-0.1, -0.1, -0.1], 4, 1) and rejected_by_folds([-0.1] * 4, 4, 1)


def test_each_finished_fold_is_logged_with_its_figures_and_beside_the_baseline():
    row = {"fold": 2, "macro_f1": 0.575, "per_class": {"N": {"f1": 0.96}, "S": {"f1": 0.58}, "V": {"f1": 0.76}}}
    assert fold_progress(row, 4) == "fold 2 of 4 done: S F1 0.580, V F1 0.760, macro-F1 0.575"
    base = {"fold": 2, "macro_f1": 0.6, "per_class": {"S": {"f1": 0.6}, "V": {"f1": 0.8}}}
    line = fold_progress(row, 4, base_row=base, figure="sv_f1", deltas=[0.0, -0.03])  # equal counts as at
    assert "; S/V F1 (mean of S F1 and V F1) 0.670 vs the baseline's 0.700 (-0.030); " in line
    assert line.endswith("; 1 of 2 folds so far at or above it")
    assert "macro-F1 0.575 vs the baseline's 0.600 (-0.025)" in fold_progress(row, 4, base_row=base, deltas=[0.0])
    # the line select echoes is found in cv's log by cv's own reader, and only that line
    assert fold_progress_in(f"[hlmtune cv] {line}\n") == line and fold_progress_in(line) is None
    assert fold_progress_in("[hlmtune cv] fold 2 of 4: holding out a b") is None
    with pytest.raises(ValueError, match="fold 2: no S/V F1"):  # a baseline fold without S: named, not a KeyError
        fold_progress(row, 4, base_row={**base, "per_class": {"V": {"f1": 0.8}}}, figure="sv_f1")


def test_a_run_may_not_take_its_own_result_as_baseline(tmp_path):
    out = tmp_path / "cv"
    assert own_result(out, out) and own_result(out / "cv_metrics.json", out)
    assert own_result(tmp_path / "x" / ".." / "cv", out)
    assert not own_result(tmp_path / "cv_b", out) and not own_result(tmp_path / "cv_b" / "cv_metrics.json", out)


def _pretrained(fold_dir, payload, name="pretrain"):
    ckpt = fold_dir / "runs" / name / "epoch_0"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "model.pt").write_bytes(payload)


def test_pretrained_models_are_named_by_their_checkpoint_bytes(tmp_path):
    import hashlib

    a, b = tmp_path / "a" / "fold1", tmp_path / "b" / "fold1"
    _pretrained(a, b"weights-0")
    # the documented format, written out: SHA-256 over each file's name, a NUL and its bytes
    assert pretrain_fingerprints(a, 1) == [hashlib.sha256(b"model.pt\0weights-0").hexdigest()[:16]]
    shutil.copytree(a, b)  # a copied job keeps its pretrained models
    assert pretrain_fingerprints(b, 1) == pretrain_fingerprints(a, 1)
    _pretrained(b, b"weights-1")  # one byte another: another model
    assert pretrain_fingerprints(b, 1) != pretrain_fingerprints(a, 1)
    assert pretrain_fingerprints(a, 2) is None  # the second pretraining is not there
    _pretrained(a, b"weights-0", name="pretrain_seed1")
    fp = pretrain_fingerprints(a, 2)
    assert len(fp) == 2 and fp[0] == fp[1]  # same bytes under both names: one content
    assert pretrain_fingerprints(tmp_path / "nothere", 1) is None


def test_the_comparison_says_where_the_pretrained_models_differ(tmp_path):
    held = [["101", "102"], ["103"], ["104"]]
    base = _cv_doc(held, [0.6, 0.5, 0.4], 0.55, 0.3)
    new = _cv_doc(held, [0.6, 0.45, 0.41], 0.56, 0.35)
    for row, fp in zip(base["folds"], (["a"], ["b"], ["c"])):
        row["pretrain_sha256"] = fp
    for row, fp in zip(new["folds"], (["a"], ["x"], ["c"])):
        row["pretrain_sha256"] = fp
    cmp = compare_to_baseline(new, base, "b")
    assert [f["same_pretraining"] for f in cmp["folds"]] == [True, False, True]
    assert pretraining_summary(cmp) == "same pretrained models in 2 of 3 folds"
    assert "**Pretrained models differ from the baseline's in fold(s) 2**" in "\n".join(baseline_lines(cmp))
    new["folds"][1]["pretrain_sha256"] = ["b"]
    cmp = compare_to_baseline(new, base, "b")
    assert pretraining_summary(cmp) == "same pretrained models in 3 of 3 folds"
    assert "Pretrained models: the baseline's in all 3 folds" in "\n".join(baseline_lines(cmp))
    del base["folds"][2]["pretrain_sha256"]  # a row written before fingerprints: unknown, not "same"
    cmp = compare_to_baseline(new, base, "b")
    assert [f["same_pretraining"] for f in cmp["folds"]] == [True, True, None]
    assert pretraining_summary(cmp) == "same pretrained models in 2 of 3 folds (1 unknown)"
    assert "not known to be the baseline's in fold(s) 3" in "\n".join(baseline_lines(cmp))
    # a baseline folder whose cv_metrics.json predates fingerprints: its checkpoints name them
    old = _cv_doc(held, [0.6, 0.5, 0.4], 0.55, 0.3)
    (tmp_path / "cv").mkdir()
    (tmp_path / "cv" / "cv_metrics.json").write_text(json.dumps(old))
    for k in (1, 2):
        _pretrained(tmp_path / "cv" / f"fold{k}", f"weights-{k}".encode())
    rows = read_baseline(tmp_path / "cv")["folds"]
    assert [r["pretrain_sha256"] for r in rows] == [pretrain_fingerprints(tmp_path / "cv" / f"fold{k}", 1)
                                                    for k in (1, 2)] + [None]
    assert rows[0]["pretrain_sha256"] != rows[1]["pretrain_sha256"]


@pytest.mark.slow
def test_cv_on_synthetic_records_pools_every_fold_and_writes_a_calibration(tmp_path):
    out = tmp_path / "cv"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("HLM_DATA", None)
    cmd = [HLMTUNE, "cv", "--out", str(out), "--source", "synthetic", "--folds", "2", "--pretrain-steps", "4",
           "--finetune-examples", "64", "--nproc", "1", "--max-eval", "150", "model.lora_rank=4",
           "dataset.num_examples=48",
           "--calibrate-classes", "N", "S", "V"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith(f"report: {out / 'report.md'}")
    folds = json.loads((out / "folds.json").read_text())["folds"]
    ds1 = json.loads((out / "data" / "synthetic" / "splits.json").read_text())
    assert sorted(r for f in folds for r in f) == sorted(ds1["DS1"])
    # DS2 is never read: the shared tokens hold the DS1 records only
    manifest = json.loads((out / "tokens" / "manifest.json").read_text())
    assert sorted(r["record"] for r in manifest["records"]) == sorted(ds1["DS1"])
    doc = json.loads((out / "cv_metrics.json").read_text())
    assert doc["n_folds"] == 2 and [r["held_out"] for r in doc["folds"]] == folds  # each fold's row is kept
    from hlmtune.hlm.report import cv_report_markdown

    # the default grouping goes unsaid; another partition is named on the report's first line
    assert doc["partition"] == 1 and "partition" not in (out / "report.md").read_text().splitlines()[0]
    assert ", partition 2 of them into folds:" in cv_report_markdown({**doc, "partition": 2}, members=[],
                                                                      baseline=[]).splitlines()[0]
    # the fine-tunes drew the override's 48 examples (it follows --finetune-examples on their command line)
    assert doc["finetune_examples"] == 48 and "48 fine-tuning examples per fold" in (out / "report.md").read_text()
    assert "on 48 training examples" in proc.stderr
    assert all(set(r["per_class"]) == set(doc["classes"]) for r in doc["folds"])
    for r in doc["folds"]:  # each fold's figures are in the log as it ends, before the pooled ones
        assert fold_progress(r, 2) in proc.stderr
    truths, lps = [], []
    for k, held in enumerate(folds, start=1):
        split = json.loads((out / f"fold{k}" / "db" / "splits.json").read_text())
        assert split["DS2"] == held and sorted(split["DS1"] + held) == sorted(ds1["DS1"])
        lora = json.loads((out / f"fold{k}" / "runs" / "lora" / "stage.json").read_text())["command"]
        assert "model.lora_rank=4" in lora  # overrides reach every fold's fine-tune
        pred = np.load(out / f"fold{k}" / "report" / "predictions.npz")
        assert pred["logprobs"].shape == (1, 150, len(doc["classes"]))
        assert np.allclose(np.exp(pred["logprobs"][0]).sum(1), 1.0, atol=1e-4)  # log-probs over the classes
        truths.append(pred["truth"])
        lps.append(pred["logprobs"][0])
    # the pooled confusion is the sum of the folds' (the uncalibrated argmax of each)
    fold_conf = [json.loads((out / f"fold{k}" / "report" / "metrics.json").read_text())["results"]["HLM (this run)"]["confusion"]
                 for k in (1, 2)]
    assert doc["pooled"]["confusion"] == (np.array(fold_conf[0]) + np.array(fold_conf[1])).tolist()
    assert doc["pooled"]["n"] == 300
    # calibration.json: the bias fitted on the pooled out-of-fold predictions, usable by eval
    bias = cal.load_calibration(out / "calibration.json", classes=doc["classes"], test_records=ds1["DS2"])
    scored = [doc["classes"].index(c) for c in ("N", "S", "V")]
    assert doc["calibrate_classes"] == ["N", "S", "V"] and bias[doc["classes"].index("F")] == 0.0
    assert np.allclose(bias, cal.fit_class_bias(np.concatenate(lps), np.concatenate(truths), scored=scored))
    nested = cal.nested_predictions(list(zip(lps, truths)), scored=scored)
    assert doc["cv_macro_f1_nested_calibration"] == pytest.approx(
        cal.macro_f1(np.concatenate(truths), np.concatenate(nested), len(doc["classes"])))
    report = (out / "report.md").read_text()
    assert "DS2 was not read" in report and "SYNTHETIC" in report and "## With a class bias" in report
    # per record, pooled: each beat under its own held-out patient, adding up to the pooled confusion
    by_rec = doc["pooled"]["per_record"]
    for k, held in enumerate(folds, start=1):
        named = np.load(out / f"fold{k}" / "report" / "predictions.npz")["record"].tolist()
        assert named and set(named) <= set(held)
        for rec in set(named):
            assert by_rec[rec]["n"] == named.count(rec)
    assert sum(v["n"] for v in by_rec.values()) == 300
    assert np.sum([v["confusion"] for v in by_rec.values()], axis=0).tolist() == doc["pooled"]["confusion"]
    assert "## Per record (pooled, uncalibrated)" in report and f"| {next(iter(by_rec))} |" in report
    # by timing, pooled: each fold's beats under their own ratio, adding up to the pooled confusion
    ratios = np.concatenate([np.load(out / f"fold{k}" / "report" / "predictions.npz")["rr_ratio"] for k in (1, 2)])
    timing = doc["pooled"]["by_timing"]
    assert timing["premature"]["n"] == int((ratios < 0.8).sum()) > 0
    assert np.sum([v["confusion"] for v in timing.values()], axis=0).tolist() == doc["pooled"]["confusion"]
    assert "## By the target beat's timing (pooled, uncalibrated)" in report
    # a rerun in a copy of the job (the original gone) keeps every fold, its evaluation included,
    # and reads the copy's own records
    copy = tmp_path / "cv_b"
    shutil.copytree(out, copy, symlinks=True)
    shutil.rmtree(out)
    base = tmp_path / "base.json"  # the first run's figures, kept as the baseline of the rerun
    shutil.copy(copy / "cv_metrics.json", base)
    proc = subprocess.run([*cmd[:2], "--out", str(copy), "--baseline", str(base), *cmd[4:]], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"against {base}: pooled macro-F1" in proc.stdout and "(+0.000); folds at or above by macro_f1: 2 of 2" in proc.stdout
    assert "fold 2 of 2 done: " in proc.stderr and proc.stderr.count(" vs the baseline's ") == 2  # each fold beside it
    assert fold_progress(doc["folds"][1], 2, base_row=doc["folds"][1], deltas=[0.0, 0.0]) in proc.stderr
    # the copy kept its pretrained models: named by the first run's rows, found again in the copy
    assert "same pretrained models in 2 of 2 folds" in proc.stdout
    assert all(len(r["pretrain_sha256"]) == 1 for r in doc["folds"])
    cmp = json.loads((copy / "cv_metrics.json").read_text())["baseline"]
    assert [f["delta"] for f in cmp["folds"]] == [0.0, 0.0] and cmp["source"] == str(base)
    assert f"## Against the baseline `{base}`" in (copy / "report.md").read_text()
    assert proc.stderr.count("finished before, kept") == 4  # pretrain + fine-tune of each fold
    assert proc.stderr.count("evaluation: finished before with these models, kept") == 2
    assert json.loads((copy / "cv_metrics.json").read_text())["pooled"] == doc["pooled"]
    links = list((copy / "fold1" / "db").glob("*.dat"))
    assert links and all(p.is_symlink() and p.resolve().is_relative_to(copy.resolve()) for p in links)
    # --need-folds: a baseline out of reach in fold 1 (2 of 2 needed) stops the run there; fold 2 is
    # not evaluated again, and the summaries the folder held (the rerun's) are gone, not left to look
    # like this run's
    high = json.loads(base.read_text())
    high["folds"][0]["macro_f1"] = 1.5
    base.write_text(json.dumps(high))
    proc = subprocess.run([*cmd[:2], "--out", str(copy), "--baseline", str(base), "--need-folds", "2", *cmd[4:]],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped after fold 1 of 2: rejected: 1 of 1 folds below the baseline" in proc.stdout, proc.stdout
    assert proc.stdout.strip().endswith(f"report: {copy / 'report.md'}")
    assert proc.stderr.count("evaluation: finished before with these models, kept") == 1
    assert "fold 2 of 2" not in proc.stderr
    beside = fold_progress(doc["folds"][0], 2, base_row=high["folds"][0], deltas=[doc["folds"][0]["macro_f1"] - 1.5])
    assert beside.endswith("; 0 of 1 folds so far at or above it") and beside in proc.stderr  # fold 1 beside the baseline's
    assert not any((copy / f).exists() for f in ("cv_metrics.json", "calibration.json"))
    stopped = json.loads((copy / "cv_stopped.json").read_text())
    assert stopped["stopped"] and stopped["folds_run"] == 1 and stopped["need_folds"] == 2 and stopped["n_folds"] == 2
    assert stopped["folds"][0]["delta"] == pytest.approx(doc["folds"][0]["macro_f1"] - 1.5)
    assert stopped["folds"][0]["same_pretraining"] is True  # the copy kept the baseline's pretrained models
    assert (copy / "report.md").read_text().startswith("**STOPPED after fold 1 of 2 (`--need-folds 2`)")
    # --figure sv_f1: the same fold 1 macro-F1 as the baseline's (at, by macro-F1), but a baseline S F1
    # out of reach: judged by the mean of S and V F1 it is below, and the run stops there
    high["folds"][0]["macro_f1"] = doc["folds"][0]["macro_f1"]
    high["folds"][0]["per_class"]["S"]["f1"] = 3.0
    base.write_text(json.dumps(high))
    proc = subprocess.run([*cmd[:2], "--out", str(copy), "--baseline", str(base), "--need-folds", "2",
                           "--figure", "sv_f1", *cmd[4:]], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped after fold 1 of 2: rejected: 1 of 1 folds below the baseline" in proc.stdout, proc.stdout
    stopped = json.loads((copy / "cv_stopped.json").read_text())
    sv = (doc["folds"][0]["per_class"]["S"]["f1"] + doc["folds"][0]["per_class"]["V"]["f1"]) / 2
    assert stopped["figure"] == "sv_f1" and stopped["folds"][0]["delta"] == 0.0
    assert stopped["folds"][0]["figure_delta"] == pytest.approx(sv - (3.0 + doc["folds"][0]["per_class"]["V"]["f1"]) / 2)
    assert "| fold | S/V F1 (mean of S F1 and V F1) | baseline | difference |" in (copy / "report.md").read_text()
    # --check-pretraining: fold 1 up to its pretrained model, in a folder of its own; the same settings
    # on this host give the baseline's bytes, and a baseline naming other bytes is told apart
    check = tmp_path / "check"
    args = [*cmd[:2], "--out", str(check), "--baseline", str(base), "--check-pretraining", *cmd[4:]]
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    digest = doc["folds"][0]["pretrain_sha256"][0]
    assert f"fold 1's pretrained model: {digest} here" in proc.stdout and "the same bytes" in proc.stdout, proc.stdout
    answer = json.loads((check / "pretrain_check.json").read_text())
    assert answer["same"] and answer["pretrain_sha256"] == answer["baseline_pretrain_sha256"] == digest
    assert answer["held_out"] == folds[0] and answer["baseline"] == str(base)
    assert sorted(p.name for p in (check / "fold1" / "runs").iterdir()) == ["pretrain"]  # no fine-tune
    assert not (check / "fold2").exists() and not (check / "cv_metrics.json").exists()
    high["folds"][0]["pretrain_sha256"] = ["0" * 16]
    base.write_text(json.dumps(high))
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "other bytes: this host computes otherwise" in proc.stdout and "finished before, kept" in proc.stderr
    assert json.loads((check / "pretrain_check.json").read_text())["same"] is False
    assert answer["kernels"] == torch.backends.cpu.get_cpu_capability() and answer["kernels_env"] == {}
    # under other kernel settings the check pretrains again (the kept stage answered for the others)
    proc = subprocess.run(args, capture_output=True, text=True, env={**env, "ATEN_CPU_CAPABILITY": "default"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished before, kept" not in proc.stderr, proc.stderr[-2000:]
    again = json.loads((check / "pretrain_check.json").read_text())
    assert again["kernels"] == "DEFAULT" and again["kernels_env"] == {"ATEN_CPU_CAPABILITY": "default"}


def test_other_bytes_on_an_avx512_host_name_the_kernel_settings_to_check_again_with():
    hint = other_bytes_hint({"same": False, "kernels": "AVX512"})
    assert "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2" in hint
    assert "AVX512 kernels" in hint
    assert other_bytes_hint({"same": True, "kernels": "AVX512"}) == ""  # the same bytes: nothing to try
    assert other_bytes_hint({"same": False, "kernels": "AVX2"}) == ""  # already AVX2 kernels
    assert other_bytes_hint({"same": False}) == ""  # an answer of an older check names no kernels


def test_through_fold_leaves_a_partial_run_that_a_candidate_can_only_be_rejected_beside(tmp_path):
    """--through-fold 1 of 2: fold 1's row in cv_partial.json, no pooled figures; a candidate beside
    it goes no further than fold 1 and only with --need-folds; the rerun without it finishes from
    the kept fold 1 and replaces the partial file with the result."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("HLM_DATA", None)
    base = tmp_path / "base"
    common = ["--source", "synthetic", "--folds", "2", "--pretrain-steps", "2", "--finetune-examples", "32",
              "--nproc", "1", "--max-eval", "60", "model.lora_rank=4", "dataset.num_examples=32"]
    proc = subprocess.run([HLMTUNE, "cv", "--out", str(base), "--through-fold", "1", *common],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "folds 1-1 of 2 finished" in proc.stdout and not (base / "fold2").exists()
    part = json.loads((base / "cv_partial.json").read_text())
    assert part["partial"] and part["through_fold"] == 1 and part["n_folds"] == 2 and len(part["folds"]) == 1
    assert part["folds"][0]["per_class"] and part["folds"][0]["pretrain_sha256"]
    assert not (base / "cv_metrics.json").exists() and not (base / "report.md").exists()
    assert read_baseline(base, partial=True)["partial"]
    with pytest.raises(FileNotFoundError, match="no cv_metrics.json"):
        read_baseline(base)  # a comparison in full needs a finished baseline
    cand = tmp_path / "cand"
    shutil.copytree(base, cand)
    for args, says in ((["--baseline", str(base)], "no cv_metrics.json"),  # judged in full: refused
                       (["--baseline", str(base), "--need-folds", "2"], "--through-fold 1 or less"),
                       (["--baseline", str(base), "--need-folds", "2", "--through-fold", "2"], "unfinished, through fold 1")):
        proc = subprocess.run([HLMTUNE, "cv", "--out", str(cand), *args, *common], capture_output=True, text=True, env=env)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    proc = subprocess.run([HLMTUNE, "cv", "--out", str(cand), "--baseline", str(base), "--need-folds", "2",
                           "--through-fold", "1", *common], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pretrain: finished before, kept" in proc.stderr  # the copy's fold-1 pretraining
    assert json.loads((cand / "cv_partial.json").read_text())["folds"][0]["per_class"] == part["folds"][0]["per_class"]
    proc = subprocess.run([HLMTUNE, "cv", "--out", str(base), *common], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"fine-tune: finished before, kept ({base / 'fold1' / 'runs' / 'lora'};" in proc.stderr  # fold 1 not redone
    doc = json.loads((base / "cv_metrics.json").read_text())
    assert doc["folds"][0]["per_class"] == part["folds"][0]["per_class"] and len(doc["folds"]) == 2
    assert not (base / "cv_partial.json").exists()


def test_a_run_stopped_beside_an_unfinished_baseline_counts_the_baselines_folds(tmp_path):
    res = FoldResults(classes=["N", "S", "V"])
    row = {"fold": 1, "held_out": ["a"], "macro_f1": 0.4, "per_class": {"S": {"f1": 0.1}, "V": {"f1": 0.3}},
           "pretrain_sha256": ["x"]}
    res.rows = [row, {**row, "fold": 2}]
    base = {"partial": True, "n_folds": 4, "folds": [{**row, "macro_f1": 0.5, "per_class": {"S": {"f1": 0.5}, "V": {"f1": 0.5}}}] * 2}
    write_stopped(tmp_path, res, base, source="b", need_folds=3, described="x", wall_s=1.0, finetune_overrides=[],
                  figure="sv_f1")
    doc = json.loads((tmp_path / "cv_stopped.json").read_text())
    assert doc["n_folds"] == 4 and doc["folds_run"] == 2 and doc["folds_below"] == 2
    assert "at most 2 of 4" in doc["verdict"]
    assert "Folds 3-4 were not run with these settings" in (tmp_path / "report.md").read_text()
    res.rows.append({**row, "fold": 3})
    write_stopped(tmp_path, res, {**base, "folds": base["folds"] * 2}, source="b", need_folds=3, described="x",
                  wall_s=1.0, finetune_overrides=[], figure="sv_f1")
    assert "after fold 3 of 4 (`--need-folds 3`): not a complete cross-validation.** Fold 4 was not run with" in \
        (tmp_path / "report.md").read_text()


def _refused(args, timeout_s=120):
    """Runs ``hlmtune cv ARGS`` expecting a refusal; a run that trains instead (a check removed) is killed after
    ``timeout_s`` (its process group; the ranks die with their launcher, hlmtune.proc) and fails the test, not the
    suite's clock."""
    proc = subprocess.Popen([HLMTUNE, "cv", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"hlmtune cv {' '.join(args)}: still running after {timeout_s} s, not refused")
    return proc.returncode, err


def test_bad_cv_arguments_are_one_line(tmp_path):
    other = tmp_path / "other.json"  # a baseline of other folds: refused before any fold trains
    other.write_text(json.dumps({"folds": [{"held_out": ["x1"]}, {"held_out": ["x2"]}], "pooled": {}, "classes": []}))
    rc, err = _refused(["--out", str(tmp_path / "cv"), "--source", "synthetic", "--folds", "2", "--baseline", str(other)])
    assert rc == 2 and "fold 1 holds out x1 there" in err, err
    assert not (tmp_path / "cv" / "fold1").exists()
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"folds": ["x1", {"held_out": ["x2"]}], "pooled": {}, "classes": []}))
    own = tmp_path / "cv" / "cv_metrics.json"  # a finished run's figures: not its own rerun's baseline
    own.parent.mkdir(exist_ok=True)
    own.write_text(json.dumps({"folds": [{"held_out": ["x1"]}, {"held_out": ["x2"]}], "pooled": {}, "classes": []}))
    # Each refusal names its own cause: a check removed would let a later one refuse in its place.
    for args, says in (
            (["--folds", "1", "--source", "synthetic"], "--folds must be 2..5"),
            (["--nproc", "0"], "--nproc must be >= 1"),
            (["notakeyvalue"], "overrides are key=value"),
            (["lora_rank=4"], "unknown key 'lora_rank'"),
            (["--calibrate-classes", "N", "X"], "AAMI classes are"),
            (["--baseline", str(tmp_path / "nothere")], "no cv_metrics.json"),
            (["--need-folds", "2", "--source", "synthetic", "--folds", "2"], "--need-folds counts folds"),
            (["--need-folds", "3", "--folds", "2", "--baseline", str(other)], "--need-folds 3: between 1 and"),
            (["--baseline", str(own), "--source", "synthetic", "--folds", "2"], "this run's own result"),
            # a figure judges against a baseline, whose folds have S / V F1, in fold rows that are rows
            (["--figure", "sv_f1", "--source", "synthetic", "--folds", "2"], "--figure sv_f1 is what a comparison"),
            (["--figure", "sv_f1", "--folds", "2", "--baseline", str(other)], "fold 1 has no S/V F1"),
            (["--figure", "sv_f1", "--folds", "2", "--baseline", str(junk)], "fold 1 has no S/V F1"),
            # --check-pretraining compares with a baseline that names its models, and trains no folds
            (["--check-pretraining", "--source", "synthetic", "--folds", "2"], "give --baseline DIR"),
            (["--check-pretraining", "--folds", "2", "--baseline", str(other)], "fold 1 names no pretrained model"),
            (["--check-pretraining", "--need-folds", "1", "--folds", "2", "--baseline", str(other)],
             "--need-folds has no folds to count"),
            (["--through-fold", "3", "--source", "synthetic", "--folds", "2"], "--through-fold 3: between 1 and"),
            (["--through-fold", "0", "--source", "synthetic", "--folds", "2"], "--through-fold 0: between 1 and"),
            (["--check-pretraining", "--through-fold", "1", "--folds", "2", "--baseline", str(other)],
             "runs fold 1's pretraining only")):
        rc, err = _refused(["--out", str(tmp_path / "cv"), *args])
        assert rc == 2 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and says in err, (args, err)
    assert own.exists()  # the refused run took nothing away
    rc, err = _refused(["--out", str(tmp_path / "cv0"), "--partition", "0", "--source", "synthetic", "--folds", "2"])
    assert rc == 2 and err.strip().splitlines() == [
        "hlmtune cv: --partition 0: 1 (the default folds) or another partition's number >= 2"], err
    assert not (tmp_path / "cv0" / "data").exists()  # refused before the data stage


def test_cv_folds_are_patient_wise_over_both_databases(mitdb_dir, tmp_path):
    """DS1 and svdb patients fold together (ids with their database), each patient in one fold,
    the S-rich ones spread; a fold's WFDB folder keeps the ids, so its shards name both databases."""
    from hlm_fixtures import svdb_style_folder
    from hlmtune.ecg_tokenizer.pipeline import RecordSource, tokenize_sources
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams
    from hlmtune.hlm.cv import _fold_db, record_class_counts, training_pool

    ds1 = sorted(p.stem for p in mitdb_dir.glob("*.hea"))[:4]
    svdb = svdb_style_folder(tmp_path / "svdb", names=("800", "802", "804", "806"), seconds=40)
    pool = training_pool(mitdb_dir, ds1, svdb)
    assert list(pool) == [f"mitdb/{r}" for r in ds1] + ["svdb/800", "svdb/802", "svdb/804", "svdb/806"]
    assert training_pool(mitdb_dir, ds1, None) == {r: mitdb_dir / r for r in ds1}  # DS1 only: names as before
    counts = record_class_counts(pool, list(pool))
    assert sum(c["N"] + c["S"] + c["V"] for c in counts.values()) > 100
    folds = make_folds(counts, 2)
    assert sorted(r for f in folds for r in f) == sorted(pool)  # a partition: every patient in one fold
    held, train = folds[0], folds[1]
    d = _fold_db(pool, tmp_path / "fold1", train, held, synthetic=False)
    assert json.loads((d / "splits.json").read_text()) == {"DS1": list(train), "DS2": list(held)}
    s = tokenize_sources([RecordSource(d, None, [*train, *held])], tmp_path / "tok", params=TokenizerParams(),
                         progress=False)
    assert s.ok, s.format()
    assert sorted(r["record"] for r in s.manifest["records"]) == sorted(pool)


def test_another_partition_groups_the_patients_anew_and_still_spreads_them():
    """``--partition P`` (P >= 2): every record in one fold, the same for the same P, folds other
    than partition 1's, and still spread in S (as partition 1's, within 1.5x of the mean)."""
    rng = np.random.default_rng(1)
    many = {f"r{i:02d}": _counts(s=int(rng.integers(0, 400)), v=int(rng.integers(0, 900)),
                                 n=int(rng.integers(1000, 3000))) for i in range(40)}
    first = make_folds(many, 4)
    assert make_folds(many, 4, 1) == first  # partition 1 is the default folds
    pairs = lambda folds: {(a, b) for f in folds for a in f for b in f if a < b}  # noqa: E731
    for p in (2, 3):
        folds = make_folds(many, 4, p)
        assert make_folds(many, 4, p) == folds  # deterministic
        assert sorted(r for f in folds for r in f) == sorted(many)
        s = [sum(many[r]["S"] for r in f) for f in folds]
        assert max(s) <= 1.5 * sum(s) / 4, s
        assert len(pairs(folds) & pairs(first)) < 0.5 * len(pairs(first))  # patients grouped anew
    assert make_folds(many, 4, 2) != make_folds(many, 4, 3)
    with pytest.raises(ValueError, match=r"^--partition 0: 1 \(the default folds\) or another partition's number >= 2$"):
        make_folds(many, 4, 0)


def test_the_partition_reaches_the_folds_file(tmp_path):
    """cv's first stage writes the partition's folds (and its number) to folds.json."""
    from hlmtune.hlm.cv import cv_setup

    setups = {p: cv_setup(tmp_path / f"p{p}", data=None, source="synthetic", svdb="none", folds=2, base=None,
                          baseline=None, partition=p) for p in (1, 2)}
    for p, setup in setups.items():
        doc = json.loads((tmp_path / f"p{p}" / "folds.json").read_text())
        assert doc["partition"] == p and doc["folds"] == make_folds(doc["counts"], 2, p) == setup.parts
    assert setups[1].parts != setups[2].parts
