"""benchmarks/ecg_quality.py around a stand-in for the pipeline (the real DS1 -> DS2 run takes
25 minutes and is the benchmark itself): the flags reach ``run_pipeline``, the printed F1,
targets and budget verdicts follow from the evaluation's confusion matrix, bad flags exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import hlmtune.hlm.pipeline as pipeline
from hlmtune.hlm.evaluate import summarize
from bench_helpers import load_benchmark

CLASSES = ["N", "S", "V", "F"]
# rows true, columns predicted (N, S, V, F): S F1 = 2*30/(2*30+10+50) = 0.5, V F1 = 2*90/(2*90+5+10) = 0.923
CONFUSION = [[900, 10, 5, 0], [50, 30, 0, 0], [10, 0, 90, 0], [4, 0, 0, 1]]


def _load():
    return load_benchmark("ecg_quality")


def _fake_pipeline(calls, train_s):
    def run_pipeline(**kw):
        calls.append(kw)
        if kw["train_only"]:  # the pipeline's training record: no report, DS2 unread
            path = Path(kw["out"]) / "training.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps({"timings": {"tokenize": 1.0, "pretrain": train_s / 2, "finetune": train_s / 2,
                                                    "kept_runs": 0, "total": train_s + 1}, "test_split_read": False}))
            return path
        rep = Path(kw["out"]) / "report"
        rep.mkdir(parents=True)
        row = summarize(CONFUSION, CLASSES)
        metrics = {"notice": "Inter-patient split: trained on DS1, tested on DS2.", "classes": CLASSES,
                   "results": {"HLM ensemble": row}, "row_order": ["HLM ensemble"], "result": "HLM ensemble"}
        (rep / "metrics.json").write_text(json.dumps(metrics, sort_keys=True))
        (rep / "timings.json").write_text(json.dumps({"tokenize": 1.0, "pretrain": train_s / 2,
                                                      "finetune": train_s / 2, "eval": 5.0}))
        (rep / "report.md").write_text("# report\n")
        return rep / "report.md"
    return run_pipeline


def _run(monkeypatch, capsys, args, train_s=600.0):
    calls = []
    monkeypatch.setattr(pipeline, "run_pipeline", _fake_pipeline(calls, train_s))
    monkeypatch.setattr(sys, "argv", ["ecg_quality.py", *args])
    try:
        rc = _load().main()
    except SystemExit as e:  # argparse errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err, calls


def test_flags_reach_the_pipeline_and_the_verdicts_follow_the_confusion(monkeypatch, capsys, tmp_path):
    rc, out, err, calls = _run(monkeypatch, capsys, ["--out", str(tmp_path / "w"), "--data", str(tmp_path),
                                                     "--pretrain-seed", "1", "--seeds", "2"])
    assert rc == 0, err
    (kw,) = calls
    assert kw["pretrain_seed"] == 1 and kw["seeds"] == 2 and kw["pretrainings"] == 1 and kw["source"] == "mitdb"
    assert kw["pretrain_steps"] == pipeline.PRETRAIN_STEPS
    assert kw["finetune_examples"] == pipeline.FINETUNE_EXAMPLES
    assert (f"pretrain {pipeline.PRETRAIN_STEPS} steps (seed 1), fine-tune {pipeline.FINETUNE_EXAMPLES} examples "
            "x 2 seeds") in out
    assert "S F1 = 0.500 (target >= 0.6: MISS)" in out
    assert "V F1 = 0.923 (target >= 0.9: PASS)" in out
    assert "training (pretrain + fine-tune) 10.0 min (budget 30 min: PASS)" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["per_class_f1"]["S"] == pytest.approx(0.5)
    assert summary["train_s"] == 600.0


def test_train_only_times_the_training_and_reads_no_test_split(monkeypatch, capsys, tmp_path):
    rc, out, err, calls = _run(monkeypatch, capsys, ["--out", str(tmp_path / "w"), "--data", str(tmp_path),
                                                     "--train-only"], train_s=32 * 60)
    assert rc == 0, err
    assert calls[0]["train_only"] is True
    assert "DS2 was not read" in out and "F1 =" not in out
    assert "training (pretrain + fine-tune) 32.0 min (budget 30 min: MISS)" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary == {"per_class_f1": None, "macro_f1": None, "train_s": 32 * 60.0, "test_split_read": False}
    rc, out, err, calls = _run(monkeypatch, capsys, ["--out", str(tmp_path / "w2"), "--data", str(tmp_path)])
    assert rc == 0 and calls[0]["train_only"] is False and "S F1 = 0.500" in out


def test_default_seed_is_zero_and_over_budget_is_a_miss(monkeypatch, capsys, tmp_path):
    rc, out, err, calls = _run(monkeypatch, capsys, ["--out", str(tmp_path / "w"), "--data", str(tmp_path)],
                               train_s=31 * 60)
    assert rc == 0, err
    assert calls[0]["pretrain_seed"] == 0 and calls[0]["seeds"] == 3
    assert "(seed" not in out.split("\n")[1]
    assert "budget 30 min: MISS" in out


def test_bad_flags_exit_2_before_any_work(monkeypatch, capsys, tmp_path):
    rc, out, err, calls = _run(monkeypatch, capsys, ["--out", str(tmp_path / "w"), "--data", str(tmp_path),
                                                     "--pretrain-seed", "-1"])
    assert rc == 2 and calls == []
    assert "--pretrain-seed must be >= 0, got -1" in err
    monkeypatch.delenv("HLM_DATA", raising=False)
    rc, out, err, calls = _run(monkeypatch, capsys, ["--out", str(tmp_path / "w")])
    assert rc == 2 and calls == [] and "set HLM_DATA" in err


def test_bad_input_is_one_line_not_a_traceback(monkeypatch, capsys, tmp_path):
    """Flags out of range are refused as hlmtune demo refuses them; the pipeline's input errors
    (no records where HLM_DATA points, a bad split file) are one line, exit 2."""
    for args, says in ((["--seeds", "1", "--pretrainings", "2"], "--pretrainings must be 1..--seeds (1)"),
                       (["--nproc", "0"], "--nproc must be >= 1, got 0")):
        rc, out, err, calls = _run(monkeypatch, capsys, ["--out", str(tmp_path / "w"), "--data", str(tmp_path), *args])
        assert rc == 2 and calls == [] and says in err, err

    def missing(**kw):
        raise FileNotFoundError("--source mitdb: no MIT-BIH records (100.hea) in $HLM_DATA/mitdb = /x/mitdb")

    monkeypatch.setattr(pipeline, "run_pipeline", missing)
    monkeypatch.setattr(sys, "argv", ["ecg_quality.py", "--out", str(tmp_path / "w"), "--data", str(tmp_path)])
    assert _load().main() == 2
    err = capsys.readouterr().err
    assert err.strip() == "ecg_quality: --source mitdb: no MIT-BIH records (100.hea) in $HLM_DATA/mitdb = /x/mitdb"
