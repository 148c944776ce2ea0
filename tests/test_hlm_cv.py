"""`hlmtune cv`: folds by patient, pooled out-of-fold predictions, the calibration it writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hlmtune.hlm import calibrate as cal
from hlmtune.hlm.cv import make_folds

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


@pytest.mark.slow
def test_cv_on_synthetic_records_pools_every_fold_and_writes_a_calibration(tmp_path):
    out = tmp_path / "cv"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("HLM_DATA", None)
    cmd = [HLMTUNE, "cv", "--out", str(out), "--source", "synthetic", "--folds", "2", "--pretrain-steps", "4",
           "--finetune-examples", "64", "--nproc", "1", "--max-eval", "150", "model.lora_rank=4",
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
    assert all(set(r["per_class"]) == set(doc["classes"]) for r in doc["folds"])
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
    # a rerun in a copy of the job (the original gone) keeps every fold, its evaluation included,
    # and reads the copy's own records
    copy = tmp_path / "cv_b"
    shutil.copytree(out, copy, symlinks=True)
    shutil.rmtree(out)
    proc = subprocess.run([*cmd[:2], "--out", str(copy), *cmd[4:]], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("finished before, kept") == 4  # pretrain + fine-tune of each fold
    assert proc.stderr.count("evaluation: finished before with these models, kept") == 2
    assert json.loads((copy / "cv_metrics.json").read_text())["pooled"] == doc["pooled"]
    links = list((copy / "fold1" / "db").glob("*.dat"))
    assert links and all(p.is_symlink() and p.resolve().is_relative_to(copy.resolve()) for p in links)


def test_bad_cv_arguments_are_one_line(tmp_path):
    for args in (["--folds", "1", "--source", "synthetic"], ["--nproc", "0"], ["notakeyvalue"], ["lora_rank=4"],
                 ["--calibrate-classes", "N", "X"]):
        proc = subprocess.run([HLMTUNE, "cv", "--out", str(tmp_path / "cv"), *args], capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
