"""`hlmtune select`: a plan of `hlmtune cv` candidates run in order and judged by its rule.

The driver is tested with a fake `hlmtune cv` (it writes the two files a real run leaves:
`cv_metrics.json` with its baseline comparison, or `cv_stopped.json`), so the rule, the carried
settings and the resume are checked exactly; one test runs the real CLI on synthetic records.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from hlmtune.hlm import select as sel

HLMTUNE = str(Path(sys.executable).with_name("hlmtune"))


def _plan(tmp_path: Path, **changes) -> Path:
    plan = {"cv": ["--folds", "4"], "env": {"HLM_TEST_ENV": "1"}, "rule": {"min_gain": 0.015, "min_folds": 3},
            "baseline": {"overrides": ["a=0"]},
            "candidates": [{"name": "good", "overrides": ["b=1"]}, {"name": "small", "overrides": ["c=1"]},
                           {"name": "early", "flags": ["--pretrain-steps", "9"]}]}
    plan.update(changes)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


class FakeCv:
    """Stands in for `hlmtune cv`: per candidate override, the fold deltas against its baseline.

    A key absent from ``deltas`` is the baseline (pooled macro-F1 0.5); ``stop`` names those that
    ``--need-folds`` stops after fold 2. With ``--figure`` the deltas are that figure's, written as cv
    writes them, and macro-F1 moves the other way (so a verdict read off macro-F1 would differ).
    ``host``: the digest fold 1 pretrains to under ``--check-pretraining`` (written as cv writes
    ``pretrain_check.json``); with ``names_models`` a baseline's result names it as fold 1's model.
    """

    def __init__(self, deltas: Dict[str, List[float]], stop=(), fail=(), host="another host's", names_models=False):
        self.deltas, self.stop, self.fail, self.calls, self.host = deltas, set(stop), set(fail), [], host
        self.names_models = names_models

    def __call__(self, cmd: List[str], env: Dict[str, str], log: Path) -> int:
        self.calls.append((cmd, env.get("HLM_TEST_ENV"), log))
        out = Path(cmd[cmd.index("--out") + 1])
        if "--check-pretraining" in cmd:
            base = Path(cmd[cmd.index("--baseline") + 1])
            theirs = json.loads((base / "cv_metrics.json").read_text())["folds"][0]["pretrain_sha256"][0]
            pretrained = out / "fold1" / "runs" / "pretrain"  # what a real check leaves: fold 1's stage
            pretrained.mkdir(parents=True, exist_ok=True)
            (pretrained / "stage.json").write_text(json.dumps({"command": ["check's"], "data": "digest"}))
            (out / "pretrain_check.json").write_text(json.dumps(
                {"pretrain_sha256": self.host, "baseline_pretrain_sha256": theirs, "same": self.host == theirs,
                 "cpu": "fake"}))
            return 0
        key = next((w for w in cmd if w in self.stop or w in self.fail), None)  # the candidate's own word
        key = key or next((w for w in reversed(cmd) if w in self.deltas), None)
        if key in self.fail:
            return 3
        n = int(cmd[cmd.index("--folds") + 1])
        through = int(cmd[cmd.index("--through-fold") + 1]) if "--through-fold" in cmd else n
        if through < n and not (key in self.stop and through >= 2):  # what cv --through-fold leaves
            out.mkdir(parents=True, exist_ok=True)
            if "--baseline" not in cmd:  # the baseline's fold stages, as a real run leaves them
                (out / f"fold{through}" / "runs" / "pretrain").mkdir(parents=True, exist_ok=True)
                (out / f"fold{through}" / "runs" / "pretrain" / "stage.json").write_text(f"fold {through}")
            for name in ("cv_metrics.json", "cv_stopped.json"):
                (out / name).unlink(missing_ok=True)
            (out / "cv_partial.json").write_text(json.dumps({"partial": True, "through_fold": through}))
            return 0
        (out / "cv_partial.json").unlink(missing_ok=True)  # as cv's clear_summaries
        if "--baseline" not in cmd:
            out.mkdir(parents=True, exist_ok=True)
            (out / "marker").write_text("baseline")
            doc = {"pooled": {"macro_f1": 0.5, "per_class": {"S": {"f1": 0.5}, "V": {"f1": 0.5}}}}  # S/V F1 0.5 too
            if self.names_models:
                doc.update(pretrainings=1, folds=[{"fold": 1, "pretrain_sha256": [self.host]}])
            (out / "cv_metrics.json").write_text(json.dumps(doc))
            return 0
        base = cmd[cmd.index("--baseline") + 1]
        (out / "cv_metrics.json").unlink(missing_ok=True)  # as cv's clear_summaries
        if key in self.stop:
            doc = {"baseline": base, "folds_run": 2, "folds": [{"delta": -0.1}, {"delta": -0.2}]}
            if "--figure" in cmd:
                doc["figure"] = cmd[cmd.index("--figure") + 1]
            (out / "cv_stopped.json").write_text(json.dumps(doc))
            return 0
        d = self.deltas[key]
        pooled = 0.5 + sum(d) / len(d)
        folds = [{"delta": x, "same_pretraining": True} for x in d]
        cmp = {"source": base, "folds_at_or_above": sum(x >= 0 for x in d), "folds": folds,
               "pooled": {"macro_f1": pooled, "baseline": 0.5, "delta": pooled - 0.5,
                          "f1": {"S": {"this": 0.6, "baseline": 0.5}}}}
        if "--figure" in cmd:
            cmp["figure"] = cmd[cmd.index("--figure") + 1]
            cmp["folds"] = [{"delta": -x, "figure_delta": x, "same_pretraining": True} for x in d]
            cmp["pooled"].update(macro_f1=1 - pooled, delta=0.5 - pooled, figure_this=pooled, figure_baseline=0.5,
                                 figure_delta=pooled - 0.5)
        this = {"macro_f1": pooled, "per_class": {"S": {"f1": pooled}, "V": {"f1": pooled}}}
        if "--figure" in cmd:  # S/V F1 is the figure; macro-F1 moved the other way
            this["macro_f1"] = 1 - pooled
        (out / "cv_metrics.json").write_text(json.dumps({"pooled": this, "baseline": cmp}))
        return 0


def test_the_rule_carries_an_adopted_setting_into_every_later_candidate(tmp_path):
    out = tmp_path / "job"
    fake = FakeCv({"b=1": [0.03, 0.03, 0.01, -0.001], "c=1": [0.02, 0.01, 0.01, 0.0]}, stop={"9"})
    rows = sel.run_plan(sel.load_plan(_plan(tmp_path)), out, runner=fake)
    assert [r["name"] for r in rows] == ["good", "small", "early"]
    assert [r["adopted"] for r in rows] == [True, False, False]
    (base_cmd, env, _), (good, _, _), (small, _, _), (early, _, _) = fake.calls
    assert env == "1"  # the plan's environment reaches every run
    assert "--baseline" not in base_cmd and base_cmd[-1] == "a=0"
    assert not any("--figure" in c for c, _, _ in fake.calls)  # macro-F1: the commands as before rule.figure
    # the first candidate against the baseline, the next ones against it: its folder, its override
    assert good[good.index("--baseline") + 1] == str(out / "baseline") and good[-2:] == ["a=0", "b=1"]
    assert small[small.index("--baseline") + 1] == str(out / "good") and small[-3:] == ["a=0", "b=1", "c=1"]
    assert small[small.index("--need-folds") + 1] == "3"
    assert early[early.index("--baseline") + 1] == str(out / "good") and "--pretrain-steps" in early
    assert (out / "small" / "marker").read_text() == "baseline"  # a copy of the baseline's folder (via good)
    assert not list(out.glob(".*.partial"))
    small_row = rows[1]
    assert small_row["pooled_delta"] == pytest.approx(0.01) and small_row["folds_at_or_above"] == 4
    assert small_row["carried"] == ["a=0", "b=1"] and small_row["s_f1"] == [0.6, 0.5]
    assert rows[2]["stopped_after_fold"] == 2 and rows[2]["pooled_macro_f1"] is None
    on_disk = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    assert on_disk == rows
    summary = (out / "plan.md").read_text()
    assert "3 of 3 candidates judged" in summary and "Adopted so far: `good`; the settings now: `a=0 b=1`." in summary
    assert "| small | `c=1` | 0.510 (+0.010) | 4 of 4 | 0.600 (+0.100) |  | 4 of 4 folds | not adopted |" in summary
    assert small_row["same_pretraining"] == 4 and "stopped after fold 2" in summary
    assert "the plan is done" in summary and "The current baseline: `good/` (pooled macro-F1 0.517)." in summary


def test_interleave_makes_the_baseline_fold_by_fold_beside_each_candidate(tmp_path):
    """--interleave: no baseline yet, so it is made through fold k beside the candidate through fold k;
    a candidate stopped after fold 2 leaves the baseline unfinished, and the next candidate goes on
    beside it until both runs are whole; the verdicts are those of a plan run without it."""
    path = _plan(tmp_path, candidates=[{"name": "early", "flags": ["--pretrain-steps", "9"]},
                                       {"name": "good", "overrides": ["b=1"]}])
    out = tmp_path / "job"
    fake = FakeCv({"b=1": [0.03, 0.03, 0.01, -0.001]}, stop={"9"})
    sel.run_plan(sel.load_plan(path), out, runner=fake, dry_run=True, interleave=True)
    assert fake.calls == []  # a dry run prints the baseline's first command, through fold 1
    rows = sel.run_plan(sel.load_plan(path), out, runner=fake, interleave=True)
    runs = [(Path(c[c.index("--out") + 1]).name, c[c.index("--through-fold") + 1]) for c, _, _ in fake.calls]
    assert runs == [("baseline", "1"), ("early", "1"), ("baseline", "2"), ("early", "2"),
                    ("baseline", "1"), ("good", "1"), ("baseline", "2"), ("good", "2"),
                    ("baseline", "3"), ("good", "3"), ("baseline", "4"), ("good", "4")]
    early = [c for c, _, _ in fake.calls if str(out / "early") in c][0]
    assert early[early.index("--baseline") + 1] == str(out / "baseline") and early[early.index("--need-folds") + 1] == "3"
    assert [r["adopted"] for r in rows] == [False, True] and rows[0]["stopped_after_fold"] == 2
    assert rows[1]["pooled_delta"] == pytest.approx(0.017, abs=1e-3) and all(r["interleaved"] for r in rows)
    for k in (1, 2):  # the baseline's fold-k pretraining reached the candidate's folder before its fold k
        assert (out / "early" / f"fold{k}" / "runs" / "pretrain" / "stage.json").read_text() == f"fold {k}"
    assert (out / "baseline" / "cv_metrics.json").exists() and not (out / "baseline" / "cv_partial.json").exists()
    assert (out / "good" / "cv_metrics.json").exists()
    assert sel.run_plan(sel.load_plan(path), out, runner=fake, interleave=True) == rows  # resumed: nothing to run
    assert len(fake.calls) == 12


def test_fixed_overrides_come_first_in_every_run_unless_the_run_sets_that_key(tmp_path):
    """A plan written while the configs shipped ``a=0, z=5`` replays so after they change: the
    baseline reads them, a candidate that sets ``a`` reads its own value only, and an adopted
    candidate's value wins over the fixed one in every later run."""
    out = tmp_path / "job"
    fake = FakeCv({"a=1": [0.03, 0.03, 0.01, 0.0], "c=1": [0.02, 0.01, 0.01, 0.0]})
    plan = sel.load_plan(_plan(tmp_path, fixed=["a=0", "z=5"], baseline={"overrides": []},
                               candidates=[{"name": "a1", "overrides": ["a=1"]}, {"name": "c1", "overrides": ["c=1"]}]))
    assert plan.fixed == ("a=0", "z=5")
    rows = sel.run_plan(plan, out, runner=fake)
    assert [r["adopted"] for r in rows] == [True, False]
    (base_cmd, _, _), (a1, _, _), (c1, _, _) = fake.calls
    assert base_cmd[-2:] == ["a=0", "z=5"]
    assert a1[-2:] == ["z=5", "a=1"] and "a=0" not in a1
    assert c1[-3:] == ["z=5", "a=1", "c=1"] and "a=0" not in c1
    assert rows[1]["carried"] == ["a=1"]  # the verdict rows name the plan's own settings, as before
    assert "every run also `a=0 z=5`, the configs as the plan was written" in (out / "plan.md").read_text()


def test_the_rule_is_at_least_min_gain_and_at_least_min_folds(tmp_path):
    plan = sel.load_plan(_plan(tmp_path))
    fake = FakeCv({"b=1": [0.015, 0.015, 0.015, -0.001], "c=1": [0.1, 0.1, -0.1, -0.05]})
    rows = sel.run_plan(plan, tmp_path / "job", runner=fake, max_candidates=2)
    assert rows[0]["pooled_delta"] == pytest.approx(0.011) and not rows[0]["adopted"]  # gain below 0.015
    assert rows[1]["folds_at_or_above"] == 2 and not rows[1]["adopted"]  # a gain, but 2 of 4 folds
    exact = sel.load_plan(_plan(tmp_path, rule={"min_gain": 0.0, "min_folds": 3}))
    fake = FakeCv({"b=1": [0.0, 0.0, 0.0, -0.001], "c=1": [0.0, 0.0, 0.0, 0.0]})
    rows = sel.run_plan(exact, tmp_path / "job2", runner=fake, max_candidates=2)
    assert rows[1]["adopted"] and rows[1]["pooled_delta"] == 0.0  # at the bar, at the fold count: adopted


def test_a_rerun_resumes_and_refuses_a_plan_changed_after_its_verdicts(tmp_path, capsys):
    out, path = tmp_path / "job", _plan(tmp_path)
    fake = FakeCv({"b=1": [0.03] * 4, "c=1": [0.0] * 4}, stop={"9"})
    first = sel.run_plan(sel.load_plan(path), out, runner=fake, max_candidates=1)
    assert [r["name"] for r in first] == ["good"] and len(fake.calls) == 2
    sel.run_plan(sel.load_plan(path), out, runner=fake, dry_run=True)
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].endswith("a=0 b=1 c=1") and len(fake.calls) == 2  # nothing run
    rows = sel.run_plan(sel.load_plan(path), out, runner=fake)
    assert [r["name"] for r in rows] == ["good", "small", "early"] and len(fake.calls) == 4  # good not rerun
    never = FakeCv({})
    assert sel.run_plan(sel.load_plan(path), out, runner=never) == rows and never.calls == []
    changed = _plan(tmp_path, candidates=[{"name": "good", "overrides": ["b=2"]}])
    with pytest.raises(ValueError, match=r"'good' was judged with .*b=1.*the plan now says .*b=2"):
        sel.run_plan(sel.load_plan(changed), out, runner=never)


def test_a_rule_by_sv_f1_judges_and_reports_that_figure(tmp_path):
    path = _plan(tmp_path, rule={"min_gain": 0.015, "min_folds": 3, "figure": "sv_f1"})
    out, plan = tmp_path / "job", sel.load_plan(path)
    # S/V F1 up in 3 of 4 folds and pooled (macro-F1 down, see FakeCv): adopted; c=1 not (gain 0.005)
    fake = FakeCv({"b=1": [0.03, 0.03, 0.01, -0.001], "c=1": [0.01, 0.01, 0.0, 0.0]}, stop={"9"})
    rows = sel.run_plan(plan, out, runner=fake)
    assert [r["adopted"] for r in rows] == [True, False, False]
    good = fake.calls[1][0]
    assert good[good.index("--figure") + 1] == "sv_f1" and good.index("--figure") > good.index("--need-folds")
    assert rows[0]["figure"] == "sv_f1" and rows[0]["pooled_figure"] == [pytest.approx(0.51725), 0.5]
    assert rows[0]["pooled_delta"] == pytest.approx(0.01725) and rows[0]["pooled_macro_f1"] == pytest.approx(0.48275)
    assert rows[0]["fold_deltas"] == [0.03, 0.03, 0.01, -0.001]
    summary = (out / "plan.md").read_text()
    assert "Rule: adopted when the pooled ensemble S/V F1 (mean of S F1 and V F1) is at least +0.015" in summary
    assert "| good | `b=1` | 0.517 (+0.017) | 3 of 4 |" in summary
    # the baseline and the current one by the rule's figure first, then macro-F1
    assert "Baseline (`a=0`): pooled S/V F1 (mean of S F1 and V F1) 0.500, pooled macro-F1 0.500." in summary
    assert "The current baseline: `good/` (pooled S/V F1 (mean of S F1 and V F1) 0.517, pooled macro-F1 0.483)" in summary
    (out / "baseline" / "cv_metrics.json").unlink()  # its folder lost: the first verdict names its figures
    sel.run_plan(plan, out, runner=FakeCv({}))
    assert ("Baseline (`a=0`): pooled S/V F1 (mean of S F1 and V F1) 0.500, pooled macro-F1 0.500 (from the first "
            "verdict; its folder is not here).") in (out / "plan.md").read_text()
    assert sel.describe(rows[0]).startswith("ADOPTED: pooled S/V F1 (mean of S F1 and V F1) 0.517 vs 0.500 (+0.017)")
    # verdicts of one figure are not resumed under a rule of another, nor a run judged by another read
    with pytest.raises(ValueError, match=r"'good' was judged with .*'figure': 'sv_f1'.*the plan now says .*macro_f1"):
        sel.run_plan(sel.load_plan(_plan(tmp_path)), out, runner=FakeCv({}))
    with pytest.raises(ValueError, match=r"good/cv_metrics.json: judged by sv_f1, but the plan's rule judges by macro_f1"):
        sel.verdict(out / "good", out / "baseline", sel.load_plan(_plan(tmp_path)))


def test_a_failed_run_names_its_log_and_leaves_no_verdict(tmp_path):
    out, rec = tmp_path / "job", tmp_path / "rec"
    with pytest.raises(RuntimeError, match=r"candidate good \(b=1\): hlmtune cv exited with 3"):
        sel.run_plan(sel.load_plan(_plan(tmp_path)), out, runner=FakeCv({}, fail={"b=1"}), record=rec)
    assert _files(rec) == ["baseline/cv_metrics.json", "plan.md"]  # the baseline's figures are kept at once
    fake = FakeCv({"b=1": [0.03] * 4}, fail={"c=1"})
    with pytest.raises(RuntimeError, match=r"candidate small \(c=1\): hlmtune cv exited with 3; its output is in .*small\.log"):
        sel.run_plan(sel.load_plan(_plan(tmp_path)), out, runner=fake)
    assert [json.loads(x)["name"] for x in (out / "verdicts.jsonl").read_text().splitlines()] == ["good"]
    (out / "verdicts.jsonl").write_text((out / "verdicts.jsonl").read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"verdicts\.jsonl: row 2 is not JSON"):
        sel.run_plan(sel.load_plan(_plan(tmp_path)), out, runner=fake)


def test_a_run_judged_against_another_baseline_is_refused(tmp_path):
    run, base = tmp_path / "run", tmp_path / "base"
    run.mkdir()
    cmp = {"source": str(tmp_path / "other"), "folds_at_or_above": 4, "folds": [],
           "pooled": {"macro_f1": 0.6, "baseline": 0.5, "delta": 0.1, "f1": {}}}
    (run / "cv_metrics.json").write_text(json.dumps({"baseline": cmp}))
    plan = sel.load_plan(_plan(tmp_path))
    with pytest.raises(ValueError, match=r"judged against .*other, but the plan's baseline here is .*base"):
        sel.verdict(run, base, plan)
    cmp["source"] = str(base / "cv_metrics.json")  # the baseline's file is the baseline
    (run / "cv_metrics.json").write_text(json.dumps({"baseline": cmp}))
    assert sel.verdict(run, base, plan)["adopted"]
    (run / "cv_metrics.json").write_text(json.dumps({"pooled": {}}))
    with pytest.raises(ValueError, match="run without --baseline"):
        sel.verdict(run, base, plan)


def test_a_stopped_run_counts_the_folds_that_kept_the_baseline_pretrained_models(tmp_path):
    run, base = tmp_path / "run", tmp_path / "base"
    run.mkdir()
    # cv_stopped.json's fold rows, as cv's write_stopped gives them (same_pretraining: tests/test_hlm_cv.py)
    folds = [{"fold": 1, "delta": -0.1, "same_pretraining": True}, {"fold": 2, "delta": -0.2, "same_pretraining": False}]
    (run / "cv_stopped.json").write_text(json.dumps({"baseline": str(base), "folds_run": 2, "folds": folds}))
    plan = sel.load_plan(_plan(tmp_path))
    assert sel.verdict(run, base, plan)["same_pretraining"] == 1  # fold 2 pretrained to other bytes
    for f in folds:
        f["same_pretraining"] = None
    (run / "cv_stopped.json").write_text(json.dumps({"baseline": str(base), "folds_run": 2, "folds": folds}))
    assert sel.verdict(run, base, plan)["same_pretraining"] is None  # the baseline names none


def _files(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_record_carries_the_plan_to_a_machine_without_its_folders(tmp_path):
    rec, path = tmp_path / "rec", _plan(tmp_path)
    fake = FakeCv({"b=1": [0.03] * 4, "c=1": [0.0] * 4}, stop={"9"})
    sel.run_plan(sel.load_plan(path), tmp_path / "job", runner=fake, max_candidates=1, record=rec)
    # the figures and the verdicts, none of the stages (the fake's "marker")
    assert _files(rec) == ["baseline/cv_metrics.json", "good/cv_metrics.json", "plan.md", "verdicts.jsonl"]
    assert (rec / "verdicts.jsonl").read_text() == (tmp_path / "job" / "verdicts.jsonl").read_text()
    out = tmp_path / "other_machine"
    fresh = FakeCv({"c=1": [0.0] * 4}, stop={"9"})
    rows = sel.run_plan(sel.load_plan(path), out, runner=fresh, record=rec)
    assert [r["name"] for r in rows] == ["good", "small", "early"]
    (small, _, _), (early, _, _) = fresh.calls  # neither the baseline nor the judged candidate again
    assert small[small.index("--baseline") + 1] == str(out / "good") and small[-3:] == ["a=0", "b=1", "c=1"]
    assert not (out / "small" / "marker").exists()  # no stages to copy: the candidate pretrains itself
    assert (rec / "verdicts.jsonl").read_text() == (out / "verdicts.jsonl").read_text()
    assert len((rec / "verdicts.jsonl").read_text().splitlines()) == 3
    assert (rec / "early" / "cv_stopped.json").exists() and (rec / "plan.md").read_text() == (out / "plan.md").read_text()
    sel.export_record(rec, tmp_path / "empty", ["good"])  # a folder without the run's result removes nothing
    assert (rec / "good" / "cv_metrics.json").exists()
    (out / "baseline" / "cv_metrics.json").write_text(json.dumps({"pooled": {"macro_f1": 0.7}}))
    with pytest.raises(ValueError, match=r"other_machine/baseline/cv_metrics\.json is not .*rec/baseline/cv_metrics"):
        sel.run_plan(sel.load_plan(path), out, runner=fresh, record=rec)
    shutil.copy(rec / "baseline" / "cv_metrics.json", out / "baseline" / "cv_metrics.json")
    row = json.loads((out / "verdicts.jsonl").read_text().splitlines()[0])
    row["adopted"] = False
    (out / "verdicts.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"rec/verdicts\.jsonl and .*other_machine/verdicts\.jsonl judge 'good' differently"):
        sel.run_plan(sel.load_plan(path), out, runner=fresh, record=rec)


def test_the_record_keeps_a_runs_latest_result_only(tmp_path):
    out, rec = tmp_path / "job", tmp_path / "rec"
    (out / "a").mkdir(parents=True)
    (out / "a" / "cv_stopped.json").write_text("{}")
    sel.export_record(rec, out, ["a"])
    assert _files(rec) == ["a/cv_stopped.json"]
    (out / "a" / "cv_stopped.json").unlink()  # the stopped run resumed and finished
    (out / "a" / "cv_metrics.json").write_text("{}")
    sel.export_record(rec, out, ["a"])
    assert _files(rec) == ["a/cv_metrics.json"]


def test_a_recorded_baseline_without_its_pretrained_models_is_remade_on_this_machine(tmp_path, capsys):
    rec, out = tmp_path / "rec", tmp_path / "job"
    (rec / "baseline").mkdir(parents=True)
    recorded = {"pooled": {"macro_f1": 0.5}, "pretrainings": 1, "folds": [{"fold": 1, "pretrain_sha256": ["ab12"]}]}
    (rec / "baseline" / "cv_metrics.json").write_text(json.dumps(recorded))
    fake = FakeCv({"b=1": [0.03] * 4})
    sel.run_plan(sel.load_plan(_plan(tmp_path)), out, runner=fake, dry_run=True, record=rec)
    printed = capsys.readouterr().out.strip().splitlines()  # the next command only: fold 1's pretraining
    assert len(printed) == 1 and fake.calls == []
    assert printed[0].endswith(f"--out {out / 'baseline.pretrain_check'} --folds 4 --baseline {out / 'baseline'} "
                               "--check-pretraining a=0")
    sel.run_plan(sel.load_plan(_plan(tmp_path)), out, runner=fake, max_candidates=1, record=rec)
    (check, _, _), (again, _, _), (good, _, _) = fake.calls  # this host pretrains to other bytes: re-made
    err = capsys.readouterr().err
    assert "--check-pretraining" in check and "other bytes" in err and "pretraining from the host check" in err
    assert again[again.index("--out") + 1] == str(out / "baseline") and "--baseline" not in again
    assert good[good.index("--baseline") + 1] == str(out / "baseline")
    # the record now holds the figures made here (the fake's names no pretrained models)
    made_here = json.loads((rec / "baseline" / "cv_metrics.json").read_text())
    assert made_here["pooled"]["macro_f1"] == 0.5 and "folds" not in made_here
    # the check's fold-1 pretraining was copied in before the re-make ran (its stamp decides whether it is kept)
    stage = out / "baseline" / "fold1" / "runs" / "pretrain" / "stage.json"
    assert stage.read_text() == (out / "baseline.pretrain_check" / "fold1" / "runs" / "pretrain" / "stage.json").read_text()
    stage.write_text("this host's own stage")  # one already there is never replaced
    sel._reuse_check_pretraining(sel._Baseline(out / "baseline", sel.Setting("baseline"), sel.Setting("carried")))
    assert stage.read_text() == "this host's own stage"
    ckpt = out / "baseline" / "fold1" / "runs" / "pretrain" / "epoch_0"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    from hlmtune.hlm.cv import pretrain_fingerprints
    recorded["folds"][0]["pretrain_sha256"] = pretrain_fingerprints(out / "baseline" / "fold1", 1)
    assert recorded["folds"][0]["pretrain_sha256"] is not None
    (out / "baseline" / "cv_metrics.json").write_text(json.dumps(recorded))
    assert sel._own_pretraining(out / "baseline")  # the models its result names are here: nothing re-made
    (ckpt / "model.safetensors").write_bytes(b"other weights")
    assert not sel._own_pretraining(out / "baseline")


def test_a_recorded_baseline_stands_where_this_host_pretrains_to_its_bytes(tmp_path, capsys):
    rec, out, path = tmp_path / "rec", tmp_path / "job", _plan(tmp_path)
    (rec / "baseline").mkdir(parents=True)
    recorded = {"pooled": {"macro_f1": 0.5}, "pretrainings": 1,
                "folds": [{"fold": 1, "pretrain_sha256": ["ab12"]}, {"fold": 2, "pretrain_sha256": ["cd34"]}]}
    (rec / "baseline" / "cv_metrics.json").write_text(json.dumps(recorded))
    fake = FakeCv({"b=1": [0.03] * 4}, host="ab12")
    rows = sel.run_plan(sel.load_plan(path), out, runner=fake, max_candidates=1, record=rec)
    (check, _, _), (good, _, _) = fake.calls  # one pretraining, then the candidate: no re-made baseline
    assert check[check.index("--out") + 1] == str(out / "baseline.pretrain_check") and check[-1] == "a=0"
    assert good[good.index("--baseline") + 1] == str(out / "baseline") and rows[0]["adopted"]
    assert "ab12 here (fake), ab12 in its result: the same bytes" in capsys.readouterr().err
    assert json.loads((rec / "baseline" / "cv_metrics.json").read_text()) == recorded  # the recorded figures stand
    assert _files(rec) == ["baseline/cv_metrics.json", "good/cv_metrics.json", "plan.md", "verdicts.jsonl"]

    def unjudged() -> None:  # "good" not judged yet: the baseline is needed again
        shutil.rmtree(out / "good")
        (out / "verdicts.jsonl").unlink()

    # an answer left for this digest is read, not asked again; one for another digest is not trusted
    unjudged()
    fake.calls.clear()
    sel.run_plan(sel.load_plan(path), out, runner=fake, max_candidates=1)
    assert [c[c.index("--out") + 1] for c, _, _ in fake.calls] == [str(out / "good")]
    unjudged()
    # the same answer is not one for kernels held to AVX2 (a plan's env): asked again under them
    (tmp_path / "held").mkdir()
    held = _plan(tmp_path / "held", env={"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    capsys.readouterr()
    sel.run_plan(sel.load_plan(held), out, runner=fake, dry_run=True)
    assert "--check-pretraining" in capsys.readouterr().out
    answer = out / "baseline.pretrain_check" / "pretrain_check.json"
    doc = json.loads(answer.read_text())
    answer.write_text(json.dumps({**doc, "kernels_env": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}))
    sel.run_plan(sel.load_plan(held), out, runner=fake, dry_run=True)  # an answer under those settings is read
    assert "--check-pretraining" not in capsys.readouterr().out
    answer.write_text(json.dumps(doc))
    answer = out / "baseline.pretrain_check" / "pretrain_check.json"
    answer.write_text(answer.read_text().replace("ab12", "ef56"))
    sel.run_plan(sel.load_plan(path), out, runner=fake, dry_run=True)
    assert "--check-pretraining" in capsys.readouterr().out  # asked again, not read off the stale answer
    recorded["folds"][0]["pretrain_sha256"] = None  # a result that names no models: re-made, nothing to check
    (out / "baseline" / "cv_metrics.json").write_text(json.dumps(recorded))
    sel.run_plan(sel.load_plan(path), out, runner=fake, dry_run=True)
    printed = capsys.readouterr().out.split()
    assert "--check-pretraining" not in printed and printed[printed.index("--out") + 1] == str(out / "baseline")


def test_a_record_keeps_each_hosts_baseline_and_a_host_like_one_of_them_makes_none(tmp_path, capsys):
    rec, path = tmp_path / "rec", _plan(tmp_path)
    (rec / "baseline").mkdir(parents=True)
    made_on_a = {"pooled": {"macro_f1": 0.5}, "pretrainings": 1, "folds": [{"fold": 1, "pretrain_sha256": ["ab12"]}]}
    (rec / "baseline" / "cv_metrics.json").write_text(json.dumps(made_on_a))
    (rec / "baseline" / "report.md").write_text("host A's report")
    # host B computes otherwise: the baseline is re-made there, host A's is kept in the record
    on_b = FakeCv({"b=1": [0.03] * 4}, host="ef56", names_models=True)
    sel.run_plan(sel.load_plan(path), tmp_path / "job_b", runner=on_b, max_candidates=1, record=rec)
    assert [c[c.index("--out") + 1] for c, _, _ in on_b.calls] == [
        str(tmp_path / "job_b" / n) for n in ("baseline.pretrain_check", "baseline", "good")]
    assert json.loads((rec / "hosts" / "ab12" / "baseline" / "cv_metrics.json").read_text()) == made_on_a
    assert (rec / "hosts" / "ab12" / "baseline" / "report.md").read_text() == "host A's report"
    made_on_b = (rec / "baseline" / "cv_metrics.json").read_text()
    assert sel._recorded_fold1(rec / "baseline") == "ef56"
    (rec / "verdicts.jsonl").unlink()  # "good" to be judged again, on host A

    # host A: its own baseline comes back from hosts/, nothing re-made; host B's is kept in its place
    on_a, job_a = FakeCv({"b=1": [0.03] * 4}, host="ab12", names_models=True), tmp_path / "job_a"
    (job_a / "baseline.pretrain_check").mkdir(parents=True)  # an answer left by an earlier check: a dry run reads it
    (job_a / "baseline.pretrain_check" / "pretrain_check.json").write_text(json.dumps(
        {"pretrain_sha256": "ab12", "baseline_pretrain_sha256": "ef56", "same": False, "cpu": "fake"}))
    sel.run_plan(sel.load_plan(path), job_a, runner=on_a, dry_run=True, record=rec)
    printed = capsys.readouterr().out.split()
    assert printed[printed.index("--out") + 1] == str(job_a / "good") and on_a.calls == []
    assert (rec / "baseline" / "cv_metrics.json").read_text() == made_on_b  # a dry run changes nothing
    rows = sel.run_plan(sel.load_plan(path), job_a, runner=on_a, max_candidates=1, record=rec)
    assert [c[c.index("--out") + 1] for c, _, _ in on_a.calls] == [str(job_a / "good")] and rows[0]["adopted"]
    assert "whose fold 1 pretrains to ab12, as this one does" in capsys.readouterr().err
    for folder in (rec / "baseline", job_a / "baseline"):
        assert json.loads((folder / "cv_metrics.json").read_text()) == made_on_a
        assert (folder / "report.md").read_text() == "host A's report"
    assert (rec / "hosts" / "ef56" / "baseline" / "cv_metrics.json").read_text() == made_on_b
    assert not (rec / "hosts" / "ab12").exists()  # one copy of each host's run

    # a third kind of host finds neither (a folder under its digest naming other models does not
    # count): re-made (check, baseline, candidate), both others kept
    (rec / "verdicts.jsonl").unlink()
    (rec / "hosts" / "9f9f" / "baseline").mkdir(parents=True)
    (rec / "hosts" / "9f9f" / "baseline" / "cv_metrics.json").write_text(json.dumps(
        {**made_on_a, "folds": [{"fold": 1, "pretrain_sha256": ["0000"]}]}))
    on_c = FakeCv({"b=1": [0.03] * 4}, host="9f9f", names_models=True)
    sel.run_plan(sel.load_plan(path), tmp_path / "job_c", runner=on_c, max_candidates=1, record=rec)
    assert len(on_c.calls) == 3 and sel._recorded_fold1(rec / "baseline") == "9f9f"
    assert sorted(p.name for p in (rec / "hosts").iterdir()) == ["9f9f", "ab12", "ef56"]
    assert sel._recorded_fold1(rec / "hosts" / "ab12" / "baseline") == "ab12"


def test_a_lost_adopted_folder_is_remade_with_its_own_settings(tmp_path, capsys):
    out, path = tmp_path / "job", _plan(tmp_path)
    sel.run_plan(sel.load_plan(path), out, runner=FakeCv({"b=1": [0.03] * 4}), max_candidates=1)
    for lost in ("baseline", "good"):
        for f in (out / lost).iterdir():
            f.unlink()
    fake = FakeCv({"b=1": [0.03] * 4, "c=1": [0.0] * 4}, stop={"9"})
    sel.run_plan(sel.load_plan(path), out, runner=fake, dry_run=True)
    remake = capsys.readouterr().out.split()
    assert remake[remake.index("--out") + 1] == str(out / "good") and fake.calls == []
    rows = sel.run_plan(sel.load_plan(path), out, runner=fake, max_candidates=1)
    (again, _, _), (small, _, _) = fake.calls
    assert again == remake and "--baseline" not in again and again[-2:] == ["a=0", "b=1"]  # not judged again
    assert small[small.index("--baseline") + 1] == str(out / "good")
    assert rows[0]["adopted"] and not (out / "baseline" / "cv_metrics.json").exists()  # the baseline: not needed
    assert "pooled macro-F1 0.500 (from the first verdict; its folder is not here)" in (out / "plan.md").read_text()


@pytest.mark.parametrize("changes, message", [
    ({"candidatse": []}, r"unknown key 'candidatse' \(did you mean 'candidates'\?\)"),
    ({"rule": {"min_gian": 0.1}}, r"rule: unknown key 'min_gian' \(did you mean 'min_gain'\?\)"),
    ({"rule": {"min_folds": 5}}, r"rule\.min_folds: between 1 and the plan's 4 folds, got 5"),
    ({"rule": {"figure": "sv_f2"}}, r"rule\.figure: 'sv_f2' is not a figure \(did you mean 'sv_f1'\?\); known: macro_f1, sv_f1"),
    ({"cv": ["--folds", "4", "--figure", "sv_f1"]}, r"cv: --figure is set by hlmtune select itself"),
    ({"candidates": [{"name": "a", "flags": ["--figure=sv_f1"]}]}, r"candidates\[0\]\.flags: --figure is set by hlmtune"),
    ({"cv": ["--folds", "2", "--baseline", "x"]}, r"cv: --baseline is set by hlmtune select itself"),
    ({"candidates": [{"name": "a", "overrides": ["b"]}]}, r"candidates\[0\]\.overrides: 'b' is not key=value"),
    ({"candidates": [{"name": "a", "overides": ["b=1"]}]}, r"candidates\[0\]: unknown key 'overides' \(did you mean 'overrides'\?\)"),
    ({"candidates": [{"name": "a", "overrides": ["b=1"]}, {"name": "a", "flags": ["--seeds", "2"]}]},
     r"the name 'a' is used twice"),
    ({"candidates": [{"name": "a"}]}, r"'a' has neither overrides nor flags"),
    ({"candidates": [{"name": "../x", "overrides": ["b=1"]}]}, r"candidates\[0\]\.name: a folder name"),
    ({"candidates": [{"name": "good.pretrain_check", "overrides": ["b=1"]}]},  # the check folder of "good"
     r"candidates\[0\]\.name: .*not ending in '\.pretrain_check'"),
    ({"cv": ["--folds", "4", "--check-pretraining"]}, r"cv: --check-pretraining is set by hlmtune select itself"),
    ({"candidates": [{"name": "a", "flags": ["9"]}]}, r"flags: starts with '9', not a --flag"),
    ({"env": ["X"]}, r"env: expected NAME: value strings"),
    ({"fixed": ["--folds"]}, r"fixed: '--folds' is not key=value"),
    ({"fixd": ["a=1"]}, r"unknown key 'fixd' \(did you mean 'fixed'\?\)"),
])
def test_bad_plans_name_the_file_and_the_key(tmp_path, changes, message):
    path = _plan(tmp_path, **changes)
    with pytest.raises(ValueError, match=message) as err:
        sel.load_plan(path)
    assert str(path) in str(err.value)


def test_packaged_plans_load_and_an_unknown_name_suggests_one():
    plans = {p.stem: sel.load_plan(p) for p in sel.PLANS_DIR.glob("*.yaml")}
    assert {"hlm_61_patients", "hlm_smoke"} <= set(plans)
    big = plans["hlm_61_patients"]
    # the plan of docs/hlm.md: its order, its rule, its environment
    assert [c.name for c in big.candidates][:3] == ["examples36k", "dropout01", "premature005"]
    assert (big.min_gain, big.min_folds, big.cv) == (0.015, 3, ("--folds", "4", "--seeds", "3"))
    assert big.env == {"HLM_ONEDNN_LINEAR": "0", "HLM_BLOCKED_ATTENTION": "1"}
    usual = plans["hlm_usual_rhythm"]  # docs/hlm.md: judged by S/V F1, its one candidate the long reference
    assert (usual.figure, usual.min_gain, usual.min_folds, usual.env) == ("sv_f1", 0.015, 3, big.env)
    assert [(c.name, c.overrides) for c in usual.candidates] == [("longrr2048", ("dataset.long_rr=2048",))]
    gated = plans["hlm_gated_rhythm"]  # docs/hlm.md: the same rule, its one candidate the gated reference
    assert (gated.figure, gated.min_gain, gated.min_folds, gated.env) == ("sv_f1", 0.015, 3, big.env)
    assert [(c.name, c.overrides) for c in gated.candidates] == [
        ("gated32", ("dataset.rr_reference=gated", "dataset.normalized_rr=32")),
        ("gated32_regular", ("dataset.rr_reference=gated_regular", "dataset.normalized_rr=32"))]
    second = plans["hlm_gated_partition2"]  # docs/hlm.md: candidate 2 again, same rule, the patients grouped anew
    assert (second.figure, second.min_gain, second.min_folds, second.env) == ("sv_f1", 0.015, 3, big.env)
    assert second.cv == ("--folds", "4", "--seeds", "3", "--partition", "2")
    assert [(c.name, c.overrides) for c in second.candidates] == [(gated.candidates[1].name, gated.candidates[1].overrides)]
    # the RR plans ran while the configs shipped the 256-beat running median; they ship the gated
    # reference since partition 2 adopted it, so each plan fixes the reference it ran with
    median = ("dataset.rr_reference=median", "dataset.normalized_rr=256")
    for p in (usual, gated, second):
        assert p.fixed == median and p.baseline.overrides == ()
        base = sel.cv_command(p, Path("b"), p.baseline, sel.Setting("carried"), None)
        assert base[-2:] == list(median)
    cand = sel.cv_command(second, Path("c"), second.candidates[0], sel.Setting("carried"), Path("b"))
    assert cand[-2:] == list(second.candidates[0].overrides) and "dataset.rr_reference=median" not in cand
    assert big.fixed[0] == "dataset.num_examples=24000"  # its baseline ran with 24,000 examples
    irregular = plans["hlm_gated_irregular"]  # docs/hlm.md: the same rule and folds, the gated reference fixed
    assert (irregular.figure, irregular.min_gain, irregular.min_folds, irregular.cv) == ("sv_f1", 0.015, 3, second.cv)
    assert irregular.fixed == second.candidates[0].overrides and irregular.env == big.env
    assert [(c.name, c.overrides) for c in irregular.candidates] == [("irregular01", ("dataset.irregular_synth=0.1",))]
    balance = plans["hlm_record_balance"]  # docs/hlm.md: the shipped settings fixed, two settings judged again by S/V F1
    assert (balance.figure, balance.min_gain, balance.min_folds, balance.cv, balance.env) == (
        "sv_f1", 0.015, 3, second.cv, big.env)
    assert balance.fixed == irregular.fixed + irregular.candidates[0].overrides
    assert [(c.name, c.overrides, c.flags) for c in balance.candidates] == [
        ("recbal05", ("dataset.record_balance=0.5",), ()), ("pretrain1200", (), ("--pretrain-steps", "1200"))]
    lead = plans["hlm_second_lead"]  # docs/hlm.md: the second lead's QRS for V, hlm_record_balance's rule and baseline
    assert (lead.figure, lead.min_gain, lead.min_folds, lead.cv, lead.env, lead.fixed) == (
        "sv_f1", 0.015, 3, second.cv, big.env, balance.fixed)
    assert [(c.name, c.overrides, c.flags) for c in lead.candidates] == [("second_lead32", ("dataset.second_lead=32",), ())]
    lr = plans["hlm_finetune_lr"]  # docs/hlm.md: the fine-tune's learning rate doubled, hlm_second_lead's rule and baseline
    assert (lr.figure, lr.min_gain, lr.min_folds, lr.cv, lr.env, lr.fixed) == (
        "sv_f1", 0.015, 3, second.cv, {**big.env, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                        "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, balance.fixed)
    assert [(c.name, c.overrides, c.flags) for c in lr.candidates] == [("lr4e-3", ("optimizer.lr=4e-3",), ())]
    for p in sel.PLANS_DIR.glob("*.yaml"):
        assert p.read_text().startswith("# "), p  # a header: what it runs, prerequisites, launch
    assert sel.resolve_plan("hlm_smoke") == sel.PLANS_DIR / "hlm_smoke.yaml"
    with pytest.raises(ValueError, match=r"no plan file 'hlm_smok' \(did you mean 'hlm_smoke'\?\)"):
        sel.resolve_plan("hlm_smok")


def test_a_runs_output_goes_whole_to_its_log_and_its_fold_lines_to_selects_output(tmp_path, capsys):
    script = ("import sys; w = sys.stdout.write; w('bar 1%\\rbar 50%\\rbar 100%\\n'); "
              "w('[hlmtune cv] fold 1 of 4 done: S F1 0.500, macro-F1 0.400\\n'); "
              "w('[hlmtune cv] fold 1 of 4: holding out a b\\n'); sys.exit(3)")
    log = tmp_path / "cand.log"
    log.write_text("earlier run\n")
    assert sel.run_process([sys.executable, "-c", script], dict(os.environ), log) == 3
    text = log.read_bytes().decode()
    assert text.startswith("earlier run\n$ ") and text.endswith(  # appended, every byte, \r kept
        "bar 1%\rbar 50%\rbar 100%\n[hlmtune cv] fold 1 of 4 done: S F1 0.500, macro-F1 0.400\n"
        "[hlmtune cv] fold 1 of 4: holding out a b\n")
    assert capsys.readouterr().err == "[hlmtune select] cand: fold 1 of 4 done: S F1 0.500, macro-F1 0.400\n"


def test_an_interrupted_select_leaves_no_run_behind(tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    script = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
              "print('[hlmtune cv] fold 1 of 4 done: S F1 0.5', flush=True); time.sleep(120)")

    def interrupted(msg):  # Ctrl-C arriving while select echoes the fold line
        raise KeyboardInterrupt

    monkeypatch.setattr(sel, "_say", interrupted)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        sel.run_process([sys.executable, "-c", script], dict(os.environ), tmp_path / "x.log")
    assert time.monotonic() - t0 < 60  # killed, not waited for (it sleeps 120 s)
    with pytest.raises(ProcessLookupError):  # and reaped, not left behind
        os.kill(int(pid_file.read_text()), 0)


def test_select_cli_runs_a_plan_on_synthetic_records_and_resumes(tmp_path):
    """The real `hlmtune cv` underneath: a candidate that restates the baseline's value trains the
    same models bit for bit, so it is judged +0.000 in 2 of 2 folds and adopted (min_gain 0)."""
    plan = tmp_path / "plan.yaml"
    smoke = yaml.safe_load((sel.PLANS_DIR / "hlm_smoke.yaml").read_text())
    smoke["rule"] = {"min_gain": 0.0, "min_folds": 2}
    smoke["candidates"] = [{"name": "same", "overrides": ["dataset.num_examples=48"]},
                           {"name": "next", "overrides": ["model.lora_rank=8"]}]
    plan.write_text(yaml.safe_dump(smoke))
    out = tmp_path / "job"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("HLM_DATA", None)
    rec = tmp_path / "rec"
    proc = subprocess.run([HLMTUNE, "select", str(plan), "--out", str(out), "--max-candidates", "1", "--record", str(rec)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + (out / "same.log").read_text()[-3000:]
    assert _files(rec) == ["baseline/cv_metrics.json", "baseline/report.md", "plan.md", "same/cv_metrics.json",
                           "same/report.md", "verdicts.jsonl"]
    assert "| 2 of 2 folds | adopted |" in (rec / "plan.md").read_text()  # the real cv's pretraining check
    assert "same: ADOPTED: pooled macro-F1" in proc.stdout and "(+0.000), 2 of 2 folds at or above" in proc.stdout
    assert proc.stdout.strip().endswith(f"summary: {out / 'plan.md'}")
    log = (out / "same.log").read_text()
    assert log.count("pretrain: finished before, kept") == 2  # the copy kept the baseline's pretrained models
    # each fold's line of the runs' cv is in select's own output as the fold ends, the candidate's beside the baseline
    assert proc.stderr.count("[hlmtune select] baseline: fold ") == 2 and "baseline: fold 2 of 2 done: " in proc.stderr
    echoed = [ln for ln in proc.stderr.splitlines() if ln.startswith("[hlmtune select] same: fold ")]
    assert len(echoed) == 2 and echoed[1].endswith("(+0.000); 2 of 2 folds so far at or above it")
    assert echoed[1].split("same: ", 1)[1] in log  # the same line as cv wrote it
    row = json.loads((out / "verdicts.jsonl").read_text())
    assert row["dir"] == str(out / "same") and row["fold_deltas"] == [0.0, 0.0]
    doc = json.loads((out / "same" / "cv_metrics.json").read_text())
    assert doc["baseline"]["source"] == str(out / "baseline")
    proc = subprocess.run([HLMTUNE, "select", str(plan), "--out", str(out), "--dry-run"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    nxt = proc.stdout.strip().splitlines()[0].split()
    assert nxt[nxt.index("--baseline") + 1] == str(out / "same")  # the adopted run is the next baseline
    assert nxt[-3:] == ["dataset.num_examples=48", "dataset.num_examples=48", "model.lora_rank=8"]
    assert not (out / "next").exists()
    # another machine with the record only: fold 1 pretrained once shows this host computes as the
    # recording one, so the recorded figures stand and the next candidate is judged against them
    other = tmp_path / "other_machine"
    proc = subprocess.run([HLMTUNE, "select", str(plan), "--out", str(other), "--max-candidates", "1", "--record",
                           str(rec)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "same: fold 1 pretrains to" in proc.stderr and "the same bytes, so its recorded figures stand" in proc.stderr
    assert not (other / "same" / "fold1").exists()  # not re-made
    assert json.loads((other / "same.pretrain_check" / "pretrain_check.json").read_text())["same"]
    rows = [json.loads(line) for line in (rec / "verdicts.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["same", "next"] and rows[1]["baseline"] == str(other / "same")
    assert rows[1]["same_pretraining"] == 2  # the candidate pretrained here to the recorded bytes, fold by fold
    for args, says in ((["nope", "--out", str(out)], "packaged plans"), (["hlm_smoke"], "--out DIR"),
                       (["hlm_smoke", "--out", str(out), "--max-candidates", "0"], "at least 1")):
        proc = subprocess.run([HLMTUNE, "select", *args], capture_output=True, text=True)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr
    proc = subprocess.run([HLMTUNE, "select", "hlm_smoke", "--show"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == (sel.PLANS_DIR / "hlm_smoke.yaml").read_text()


def test_a_job_stops_before_a_candidate_once_its_plan_file_holds_other_runs(tmp_path, capsys):
    """A plan edited while its job runs (a candidate added or moved): the job stops before the next
    candidate instead of running the order it read; a verdict noted in the YAML's comments or
    description does not stop it; the rerun goes on with the plan as it is now."""
    out, path = tmp_path / "job", _plan(tmp_path)
    plan = sel.load_plan(path)

    class Editing(FakeCv):
        def __call__(self, cmd, env, log):
            rc = super().__call__(cmd, env, log)
            if "b=1" in cmd:  # while the first candidate runs: a note, then a new candidate placed second
                raw = yaml.safe_load(path.read_text())
                path.write_text("# good: judged\n" + yaml.safe_dump({**raw, "description": "good: not adopted"}))
                assert not sel._plan_changed(plan)
                raw["candidates"].insert(1, {"name": "new", "overrides": ["d=1"]})
                path.write_text(yaml.safe_dump(raw))
            return rc

    fake = Editing({"b=1": [0.0] * 4, "c=1": [0.0] * 4, "d=1": [0.0] * 4}, stop={"9"})
    rows = sel.run_plan(plan, out, runner=fake)
    assert [r["name"] for r in rows] == ["good"] and len(fake.calls) == 2  # baseline, good; "small" not run
    assert "stopped before candidate small" in capsys.readouterr().err
    rows = sel.run_plan(sel.load_plan(path), out, runner=fake)
    assert [r["name"] for r in rows] == ["good", "new", "small", "early"]
    assert "d=1" in fake.calls[2][0] and "c=1" in fake.calls[3][0]


def test_a_killed_select_takes_its_cv_along(tmp_path):
    """kill -9 of select (no handler runs, unlike Ctrl-C above): its cv dies too (hlmtune.proc)."""
    from proc_utils import child_outlives_a_killed_parent

    assert not child_outlives_a_killed_parent(
        tmp_path, "from hlmtune.hlm import select; select.run_process(CMD, dict(os.environ), LOG)")
