"""The main job (`hlmtune demo`) end to end on synthetic records, as CI runs it; reruns resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
HLMTUNE = str(Path(sys.executable).with_name("hlmtune"))
QUICK = ["--source", "synthetic", "--pretrain-steps", "6", "--finetune-examples", "96", "--nproc", "1",
         "--max-eval", "96"]


def losses_of(run: Path) -> list:
    return [json.loads(x)["loss"] for x in (run / "metrics" / "steps.jsonl").read_text().splitlines()]


def test_main_job_on_synthetic_ecg_writes_the_report_and_resumes(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("HLM_DATA", None)  # a newcomer's clone: no data folder
    proc = subprocess.run([HLMTUNE, "demo", "--out", str(out), *QUICK, "--seeds", "2"], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out / "report" / "report.md"
    assert proc.stdout.strip().endswith(f"report: {report}")
    text = report.read_text()
    assert "SYNTHETIC ECG" in text and "not comparable" in text.lower()
    for section in ("## Results on the test split", "## Beside the published inter-patient baselines",
                    "## Training", "de Chazal et al. 2004", "![loss.png](loss.png)"):
        assert section in text
    for png in ("loss.png", "iteration_time.png", "peak_memory.png", "confusion.png"):
        assert (out / "report" / png).stat().st_size > 1000
    m = json.loads((out / "report" / "metrics.json").read_text())
    assert m["n_examples"] == 96 and m["task"] == "beat"
    # --seeds 2: two fine-tunes of one pretrained model (seed 1 differs: its own draw), one ensemble
    assert [Path(w).parent.parent.name for w in m["ensemble"]] == ["lora", "lora_seed1"]
    assert m["result"] == m["row_order"][0] == "HLM ensemble of 2 runs (mean class log-prob)"
    assert "an ensemble of 2 LoRA fine-tunes" in text and "| LoRA fine-tune seed 1 |" in text
    assert losses_of(out / "runs" / "lora") != losses_of(out / "runs" / "lora_seed1")
    steps = [json.loads(x) for x in (out / "runs" / "pretrain" / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 6 and all("iteration_time_s" in s and "peak_rss_gib" in s for s in steps)
    # every stage stamps what it read (the shards and split lists), the same digest throughout
    digests = {json.loads((out / d / "stage.json").read_text())["data"] for d in ("runs/pretrain", "runs/lora", "report")}
    assert len(digests) == 1 and len(digests.pop()) == 64
    # `hlmtune eval --config <job folder>` scores the job's final models as the job did: its ensemble
    again = subprocess.run([HLMTUNE, "eval", "--config", str(out), "--out", str(tmp_path / "job_eval")],
                           capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "job " + str(out) + ": lora + lora_seed1" in again.stderr
    import numpy as np

    mine, jobs = np.load(tmp_path / "job_eval" / "predictions.npz"), np.load(out / "report" / "predictions.npz")
    n = jobs["logprobs"].shape[1]  # the job scored its first 96 beats (--max-eval), this every test beat
    assert list(mine["rows"]) == list(jobs["rows"]) and mine["logprobs"].shape[1] > n
    # other batches (983 beats, not 96) pad differently: the same up to float rounding, the same calls
    assert np.allclose(mine["logprobs"][:, :n], jobs["logprobs"], atol=1e-5)
    assert np.array_equal(mine["logprobs"][0, :n].argmax(-1), jobs["logprobs"][0].argmax(-1))
    # a rerun keeps the trained stages and rebuilds the report; one seed is the first run alone
    proc = subprocess.run([HLMTUNE, "demo", "--out", str(out), *QUICK], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pretrain: finished before, kept" in proc.stderr and "fine-tune: finished before, kept" in proc.stderr
    m = json.loads((out / "report" / "metrics.json").read_text())
    assert list(m["results"]) == ["HLM (this run)"] == m["row_order"] and m["ensemble"] == []
    # the headline row's per-record table: one row per test record, its beats adding up to the test set
    text = (out / "report" / "report.md").read_text()
    head = m["results"][m["result"]]
    assert f"## Per record: {m['result']}" in text
    rows = [x.split("|") for x in text.splitlines() if x.startswith("| ") and x.split("|")[1].strip() in head["per_record"]]
    assert sorted(r[1].strip() for r in rows) == sorted(head["per_record"])
    assert sum(int(r[2]) for r in rows) == m["n_examples"]
    timing = head["by_timing"]  # the demo's inputs read normalized RR tokens
    assert sum(v["n"] for v in timing.values()) == m["n_examples"]
    assert f"## By the target beat's timing: {m['result']}" in text and "| on time (>= 0.8) |" in text
    # an evaluation stamped by an older format (here: before predictions.npz named each beat's
    # record, the stamp had no "format") is redone on rerun; the trained models are kept
    import numpy as np

    stamp = out / "report" / "stage.json"
    asked = json.loads(stamp.read_text())
    assert asked.pop("format") >= 2
    stamp.write_text(json.dumps(asked))
    npz = out / "report" / "predictions.npz"
    with np.load(npz) as z:
        old = {k: z[k] for k in z.files if k != "record"}
    np.savez(npz, **old)
    proc = subprocess.run([HLMTUNE, "demo", "--out", str(out), *QUICK], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fine-tune: finished before, kept" in proc.stderr and "evaluation: finished before" not in proc.stderr
    with np.load(npz) as z:
        assert z["record"].size == 96
    proc = subprocess.run([HLMTUNE, "demo", "--out", str(out), *QUICK], capture_output=True, text=True, env=env)
    assert "evaluation: finished before with these models, kept" in proc.stderr
    # a missing output of the evaluation (what `hlmtune cv` pools) redoes it
    npz.unlink()
    proc = subprocess.run([HLMTUNE, "demo", "--out", str(out), *QUICK], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "evaluation: finished before" not in proc.stderr, proc.stderr[-3000:]
    assert npz.is_file()
    # --pretrainings 2: fine-tune 1 starts from a second pretrained model (seed 1); the first pair is kept
    proc = subprocess.run([HLMTUNE, "demo", "--out", str(out), *QUICK, "--seeds", "2", "--pretrainings", "2"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pretrain: finished before, kept" in proc.stderr and "fine-tune: finished before, kept" in proc.stderr
    assert "seed 1 (2 of 2)" in proc.stderr  # the second pretraining ran
    m = json.loads((out / "report" / "metrics.json").read_text())
    assert [Path(w).parent.parent.name for w in m["ensemble"]] == ["lora", "lora_seed1_pre1"]
    assert losses_of(out / "runs" / "pretrain_seed1") != losses_of(out / "runs" / "pretrain")
    stamp = json.loads((out / "runs" / "lora_seed1_pre1" / "stage.json").read_text())["command"]
    assert "pretrain_dir={job}/runs/pretrain_seed1" in stamp and not any(str(out.resolve()) in x for x in stamp)
    text = (out / "report" / "report.md").read_text()
    assert "2 pretrained models" in text and "| pretrain seed 1 |" in text
    # the kept pair counts with the time it took when it ran: training time is the models' cost
    timings = json.loads((out / "report" / "timings.json").read_text())
    assert timings["kept_runs"] == 2
    made = {r: json.loads((out / "runs" / r / "stage.json").read_text())["wall_s"]
            for r in ("pretrain", "pretrain_seed1", "lora", "lora_seed1_pre1")}
    assert timings["pretrain"] > made["pretrain"] > 1.0
    assert abs(timings["finetune"] - made["lora"] - made["lora_seed1_pre1"]) < 1.0
    assert f"| {made['pretrain']:.0f} (kept) (" in text
    # a copy of the job folder, the original gone: every stage is kept, and an evaluation redone
    # there reads the copy's own models (the runs' saved configs name the original's paths)
    moved = tmp_path / "moved" / "demo"
    shutil.copytree(out, moved, symlinks=True)
    shutil.rmtree(out)
    (moved / "report" / "predictions.npz").unlink()
    proc = subprocess.run([HLMTUNE, "demo", "--out", str(moved), *QUICK, "--seeds", "2", "--pretrainings", "2"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("finished before, kept") == 4 and "evaluation: finished before" not in proc.stderr
    m = json.loads((moved / "report" / "metrics.json").read_text())
    assert m["ensemble"] and all(str(moved.resolve()) in w for w in m["ensemble"])
    # --pretrain-seed 1: the first pretraining is redone with seed 1, the same model the
    # second pretraining above made (seed 1 on the same data), and its fine-tune is redone
    proc = subprocess.run([HLMTUNE, "demo", "--out", str(moved), *QUICK, "--pretrain-seed", "1"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pretrain (seed 1): the run in" in proc.stderr and "fine-tune: finished before" not in proc.stderr
    assert losses_of(moved / "runs" / "pretrain") == losses_of(moved / "runs" / "pretrain_seed1")
    assert "| pretrain seed 1 |" in (moved / "report" / "report.md").read_text()


def test_bad_flags_and_outputs_are_one_line(tmp_path):
    taken = tmp_path / "file"
    taken.write_text("x")
    for args in (["--out", str(taken), *QUICK], ["--out", str(tmp_path / "d"), "--nproc", "0"],
                 ["--out", str(tmp_path / "d"), "--data", str(tmp_path)],
                 ["--out", str(tmp_path / "d"), *QUICK, "--seeds", "2", "--pretrainings", "3"],
                 ["--out", str(tmp_path / "d"), "--pretrainings", "0"],
                 ["--out", str(tmp_path / "d"), "--pretrain-seed", "-1"],
                 ["--out", str(tmp_path / "d"), *QUICK, "--max-eval", "0"]):
        proc = subprocess.run([HLMTUNE, "demo", *args], capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_bad_split_file_is_one_line_naming_it(tmp_path):
    """Not JSON, no DS1 list, or a record in both lists: `hlmtune demo` and `hlmtune cv` name the
    file in one line (exit 2) before anything is tokenized or trained."""
    db = tmp_path / "db"
    db.mkdir()
    for text, says in (("{", "not JSON"), (json.dumps({"train": ["a"]}), "must hold lists 'DS1'"),
                       (json.dumps({"DS1": ["a", "b"], "DS2": ["b"]}), r"records in both DS1 and DS2: ['b']")):
        (db / "splits.json").write_text(text)
        for cmd in ("demo", "cv"):
            proc = subprocess.run([HLMTUNE, cmd, "--data", str(db), "--out", str(tmp_path / cmd)], capture_output=True,
                                  text=True)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr
            assert str(db / "splits.json") in proc.stderr
            assert not (tmp_path / cmd / "tokens").exists()


def test_a_download_is_complete_or_not_there(tmp_path, monkeypatch):
    """MIT-BIH is downloaded beside its place and renamed when complete: an interrupted download
    does not pass for the database, and the rerun resumes it. $HLM_DATA without records is named."""
    import wfdb

    from hlmtune.hlm.pipeline import find_data

    calls = []

    def dl(db, dl_dir, **kw):
        calls.append(dl_dir)
        d = Path(dl_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / "100.hea").write_text("x")
        if len(calls) == 1:
            raise ConnectionError("connection reset")  # an OSError, as requests raises
        (d / "234.atr").write_text("x")

    monkeypatch.setattr(wfdb, "dl_database", dl)
    monkeypatch.delenv("HLM_DATA", raising=False)
    dest = tmp_path / "data" / "mitdb"
    with pytest.raises(FileNotFoundError, match="cannot download MIT-BIH"):
        find_data(None, tmp_path, "download")
    assert not dest.exists() and (tmp_path / "data" / "mitdb.partial" / "100.hea").exists()
    db, described, _ = find_data(None, tmp_path, "download")
    assert db == dest and (dest / "234.atr").exists() and not (tmp_path / "data" / "mitdb.partial").exists()
    assert calls == [str(tmp_path / "data" / "mitdb.partial")] * 2 and "downloaded" in described
    assert find_data(None, tmp_path, "download")[0] == dest and len(calls) == 2  # complete: not downloaded again
    monkeypatch.setenv("HLM_DATA", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"no MIT-BIH records \(100.hea\) in \$HLM_DATA/mitdb = "):
        find_data(None, tmp_path, "mitdb")


def test_a_failed_rerun_leaves_no_report_of_the_models_it_replaced(tmp_path, monkeypatch):
    """A missing --calibration file is refused before any work; a stage that fails leaves no
    report.md (the previous one described the models being replaced)."""
    from hlmtune.hlm import pipeline

    out = tmp_path / "job"
    with pytest.raises(FileNotFoundError, match="--calibration .*nope.json: no such file"):
        pipeline.run_pipeline(out=out, source="synthetic", calibration=tmp_path / "nope.json")
    assert not out.exists()
    (out / "report").mkdir(parents=True)
    (out / "report" / "report.md").write_text("# the previous models' report\n")

    def fails(name, *a, **kw):
        raise RuntimeError(f"{name} failed (see its train.log)")

    monkeypatch.setattr(pipeline, "_train_stage", fails)
    with pytest.raises(RuntimeError, match="pretrain failed"):
        pipeline.run_pipeline(out=out, source="synthetic", nproc=1)
    assert not (out / "report" / "report.md").exists()


def test_a_database_with_a_split_file_is_named_for_what_it_is(tmp_path):
    """A real WFDB database given with a splits.json is not called synthetic; a synthetic one is."""
    from hlmtune.hlm.pipeline import find_data, synthetic_database

    real = tmp_path / "mydb"
    real.mkdir()
    (real / "splits.json").write_text(json.dumps({"DS1": ["a01"], "DS2": ["a02"]}))
    _, described, split_file = find_data(str(real), tmp_path, "auto")
    assert split_file == real / "splits.json" and "synthetic" not in described.lower() and str(real) in described
    synth = synthetic_database(tmp_path / "synth", n_records=2, duration_s=20)
    _, described, _ = find_data(str(synth), tmp_path, "auto")
    assert described.startswith("SYNTHETIC ECG")


def test_a_stage_is_kept_only_when_its_settings_are_the_same(tmp_path, capsys):
    """Same command: kept; other settings, a missing record of them, or --force: run again."""
    from hlmtune.hlm.pipeline import STAGE_STAMP, _train_stage

    run_dir, count = tmp_path / "run", tmp_path / "count"
    done = run_dir / "model.pt"
    script = f"import pathlib; pathlib.Path({str(done)!r}).write_text('w'); " \
             f"c = pathlib.Path({str(count)!r}); c.write_text(str(int(c.read_text() or 0) + 1) if c.exists() else '1')"

    def stage(examples, force=False):
        cmd = [sys.executable, "-c", script, f"dataset.num_examples={examples}"]
        return _train_stage("fine-tune", run_dir, done, force, dict(os.environ), "training", cmd)[1]

    assert stage(100) is True and count.read_text() == "1"
    assert stage(100) is False and count.read_text() == "1"
    assert "finished before, kept" in capsys.readouterr().err
    assert stage(200) is True and count.read_text() == "2"
    assert "other settings" in capsys.readouterr().err
    (run_dir / STAGE_STAMP).unlink()  # a run of an older version: no record of its settings
    assert stage(200) is True and count.read_text() == "3"
    assert stage(200, force=True) is True and count.read_text() == "4"
    assert stage(200) is False

    # the same command over other data (records re-tokenized, another split file, same paths)
    def on(data):
        cmd = [sys.executable, "-c", script, "dataset.num_examples=200"]
        return _train_stage("fine-tune", run_dir, done, False, dict(os.environ), "training", cmd, data=data)[1]

    capsys.readouterr()
    assert on("d1") is False and json.loads((run_dir / STAGE_STAMP).read_text())["data"] == "d1"  # older stamp: digest added
    assert on("d1") is False and count.read_text() == "4"
    assert on("d2") is True and count.read_text() == "5"
    assert "made with other data (records or split file): redoing it" in capsys.readouterr().err
    assert on("d2") is False and json.loads((run_dir / STAGE_STAMP).read_text())["data"] == "d2"


def test_the_data_digest_follows_the_shards_and_the_split_not_the_bookkeeping(tmp_path):
    """What the models read changes the digest: a record's shard, the tokenizer parameters, the
    split lists; the library versions in the manifest and records the job does not read do not."""
    from hlmtune.hlm.pipeline import data_digest

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    rec = lambda name, sha: {"record": name, "outputs": {"tokens": {"sha256": sha}, "beats": {"sha256": "b" + sha}}}
    manifest = {"params": {"rr_bins": 64}, "libraries": {"numpy": "2.0"}, "records": [rec("a", "1"), rec("b", "2")]}

    def digest(m=manifest, lists={"DS1": ["a"], "DS2": ["b"]}, records=("a", "b")):
        (tokens / "manifest.json").write_text(json.dumps(m))
        return data_digest(tokens, lists, records)

    first = digest()
    assert digest() == first
    assert digest({**manifest, "libraries": {"numpy": "2.4"}}) == first
    assert digest({**manifest, "records": [*manifest["records"], rec("c", "3")]}) == first  # not one of the job's
    assert digest({**manifest, "records": [rec("a", "1"), rec("b", "9")]}) != first
    assert digest({**manifest, "params": {"rr_bins": 32}}) != first
    assert digest(lists={"DS1": ["b"], "DS2": ["a"]}) != first
    # the second lead's windows: what the fine-tunes read changes, what the pretraining reads does not
    with_lead2 = {**manifest, "records": [{**r, "outputs": {**r["outputs"], "lead2": {"sha256": "v" + r["record"]}}}
                                          for r in manifest["records"]]}
    assert digest(with_lead2) != first
    (tokens / "manifest.json").write_text(json.dumps(with_lead2))
    kinds = ("beats", "tokens")
    assert data_digest(tokens, {"DS1": ["a"], "DS2": ["b"]}, ("a", "b"), outputs=kinds) == first
    (tokens / "manifest.json").write_text(json.dumps(manifest))
    assert data_digest(tokens, {"DS1": ["a"], "DS2": ["b"]}, ("a", "b"), outputs=kinds) == first


def test_the_second_lead_is_tokenized_when_the_fine_tunes_read_it():
    """The last ``dataset.second_lead`` override decides; without one, the ecg_lora config (off)."""
    from hlmtune.hlm.pipeline import wants_second_lead

    assert wants_second_lead([]) is False
    assert wants_second_lead(["dataset.second_lead=32"]) is True
    assert wants_second_lead(["dataset.second_lead=32", "dataset.second_lead=0"]) is False
    assert wants_second_lead(["dataset.next_rr=False", " dataset.second_lead = 16"]) is True
    assert wants_second_lead(["dataset.second_lead=x"]) is True  # the recipe's validation names the value


def test_a_kept_stage_reports_the_time_it_took_when_it_ran(tmp_path, capsys):
    """Keeping a run costs nothing, but the report's training time is what the run cost to make."""
    from hlmtune.hlm.pipeline import STAGE_STAMP, _train_stage

    run_dir = tmp_path / "run"
    done = run_dir / "model.pt"
    cmd = [sys.executable, "-c", f"import pathlib, time; time.sleep(0.4); pathlib.Path({str(done)!r}).write_text('w')"]
    took, ran = _train_stage("pretrain", run_dir, done, False, dict(os.environ), "training", cmd)
    assert ran and took >= 0.4
    recorded = json.loads((run_dir / STAGE_STAMP).read_text())["wall_s"]
    assert abs(recorded - took) < 1e-2
    kept, ran = _train_stage("pretrain", run_dir, done, False, dict(os.environ), "training", cmd)
    assert not ran and kept == recorded
    # kept from a version that recorded no time: unknown, not zero
    (run_dir / STAGE_STAMP).write_text(json.dumps({"command": cmd[1:]}))
    assert _train_stage("pretrain", run_dir, done, False, dict(os.environ), "training", cmd) == (None, False)


def test_stamps_name_the_job_folder_so_a_copy_keeps_its_stages(tmp_path, capsys):
    """Paths inside the job are stamped relative to it; a sibling folder or outside data is not."""
    from hlmtune.hlm.pipeline import STAGE_STAMP, _train_stage, portable

    job, data = tmp_path / "cv", tmp_path / "data"
    assert portable([f"shards_dir={job}/tokens", f"x={job}_b/tokens", f"db={data}", str(job), f"out={job}"], job) == [
        "shards_dir={job}/tokens", f"x={job}_b/tokens", f"db={data}", "{job}", "out={job}"]
    assert portable([f"a={job}/t"], None) == [f"a={job}/t"]

    def stage(root):
        run_dir = root / "fold1" / "runs" / "lora"
        done = run_dir / "model.pt"
        write = "import pathlib, sys; pathlib.Path(sys.argv[1].split('=', 1)[1], 'model.pt').write_text('w')"
        cmd = [sys.executable, "-c", write, f"output_dir={run_dir}", f"shards_dir={root}/tokens", f"data={data}"]
        return _train_stage("fine-tune", run_dir, done, False, dict(os.environ), "training", cmd, root=root)[1]

    assert stage(job) is True
    stamp = json.loads((job / "fold1" / "runs" / "lora" / STAGE_STAMP).read_text())["command"]
    assert stamp[-3:] == ["output_dir={job}/fold1/runs/lora", "shards_dir={job}/tokens", f"data={data}"]
    shutil.copytree(job, tmp_path / "cv_b")
    shutil.rmtree(job)
    assert stage(tmp_path / "cv_b") is False and "finished before, kept" in capsys.readouterr().err
    # a stamp of an older version (absolute paths) still counts where it was made
    old = tmp_path / "cv_b" / "fold1" / "runs" / "lora" / STAGE_STAMP
    cmd = json.loads(old.read_text())["command"]
    old.write_text(json.dumps({"command": [c.replace("{job}", str(tmp_path / "cv_b")) for c in cmd], "wall_s": 7.0}))
    shutil.copytree(tmp_path / "cv_b", tmp_path / "cv_c")
    assert stage(tmp_path / "cv_b") is False
    # ... and in a copy of its job (the folder it was made in read from its output_dir), where
    # keeping it rewrites it job-relative, its wall time kept
    assert stage(tmp_path / "cv_c") is False
    upgraded = json.loads((tmp_path / "cv_c" / "fold1" / "runs" / "lora" / STAGE_STAMP).read_text())
    assert upgraded == {"command": cmd, "wall_s": 7.0}
    # an old stamp naming another run's output_dir is not this run's
    other = [c.replace("{job}/fold1", str(tmp_path / "cv_b") + "/fold2") for c in cmd]
    old.write_text(json.dumps({"command": other}))
    assert stage(tmp_path / "cv_b") is True
    # another data folder is another setting
    data = tmp_path / "data2"
    assert stage(tmp_path / "cv_b") is True


def test_the_examples_a_fine_tune_draws_are_the_last_override_s():
    """A dataset.num_examples override follows --finetune-examples on the command line, so it wins."""
    from hlmtune.hlm.pipeline import examples_trained

    assert examples_trained(24000, []) == 24000
    assert examples_trained(24000, ["model.lora_rank=4", "dataset.num_examples=36000"]) == 36000
    assert examples_trained(24000, ["dataset.num_examples=100", "dataset.num_examples = 200"]) == 200
    assert examples_trained(24000, ["dataset.num_examples_x=5", "num_examples=7"]) == 24000
    assert examples_trained(24000, ["dataset.num_examples=many"]) == 24000


def test_pretrain_config_runs_as_long_as_the_main_job():
    """configs/ecg_pretrain.yaml, run by hand, pretrains as long as `hlmtune demo` / `hlmtune cv` do."""
    import yaml

    from hlmtune.hlm.pipeline import PRETRAIN_STEPS

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "ecg_pretrain.yaml").read_text())
    assert cfg["max_steps_per_epoch"] == PRETRAIN_STEPS


def test_lora_config_fine_tunes_as_many_examples_as_the_main_job():
    """configs/ecg_lora.yaml, run by hand, draws the examples `hlmtune demo` / `hlmtune cv` / ecg_quality do."""
    import yaml

    from hlmtune.hlm.pipeline import FINETUNE_EXAMPLES

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "ecg_lora.yaml").read_text())
    assert cfg["dataset"]["num_examples"] == FINETUNE_EXAMPLES


def test_pretrain_steps_beyond_an_epoch_overlap_the_windows(tmp_path):
    """--pretrain-steps more than an epoch of packed windows holds: windows start closer, one epoch holds the steps."""
    sys.path.insert(0, str(Path(__file__).parent))
    from hlm_fixtures import make_shards

    from hlmtune.data_builders.ecg import ecg_pretrain_dataset
    from hlmtune.ecg_tokenizer.tokenizer import ecg_tokenizer
    from hlmtune.hlm.pipeline import MAX_WINDOW_OVERLAP, pretrain_schedule

    sh = make_shards(tmp_path)
    tokens, split_file = Path(sh["shards"]), Path(sh["split_file"])
    tok = ecg_tokenizer(manifest_path=str(tokens))

    def epoch(stride, nproc):  # the recipe's loader: equal per-rank blocks, batches of 8, last dropped
        ds = ecg_pretrain_dataset(tok, shards_dir=str(tokens), max_seq_len=512, stride=stride, split_file=str(split_file))
        return len(ds) // nproc // 8

    for nproc in (1, 2):
        packed = epoch(None, nproc)
        assert packed >= 2
        assert pretrain_schedule(packed, tokens, split_file, nproc) == (None, packed)  # fits: the config's own windows
        assert pretrain_schedule(1, tokens, split_file, nproc) == (None, 1)
        stride, steps = pretrain_schedule(packed + 1, tokens, split_file, nproc)
        assert (stride, steps) == (256, packed + 1) and epoch(256, nproc) >= packed + 1
        stride, steps = pretrain_schedule(3 * packed, tokens, split_file, nproc)
        assert steps == 3 * packed <= epoch(stride, nproc) and epoch(512 // (512 // stride - 1), nproc) < 3 * packed
        # Past MAX_WINDOW_OVERLAP-fold overlap (windows every 128 tokens) it stops at that epoch's end.
        densest = epoch(512 // MAX_WINDOW_OVERLAP, nproc)
        assert MAX_WINDOW_OVERLAP == 4 and densest < 100 * packed
        assert pretrain_schedule(100 * packed, tokens, split_file, nproc) == (128, densest)
    with pytest.raises(ValueError, match="--pretrain-steps must be >= 1"):
        pretrain_schedule(0, tokens, split_file, 1)


def test_the_driver_runs_the_stages_in_order_on_stand_in_stages(tmp_path, monkeypatch):
    """run_pipeline is a driver: data -> tokenize -> pretrain -> fine-tune -> evaluate -> report, each
    stage handed what the one before produced."""
    from hlmtune.hlm import pipeline as pl

    calls = []
    pre = pl.Trained([tmp_path / "p"], [1.0], [True], [0])
    ft = pl.Trained([tmp_path / "f"], [2.0], [False], [0])
    monkeypatch.setattr(pl, "stage_data", lambda job, **kw: calls.append(("data", kw["svdb"])))
    monkeypatch.setattr(pl, "stage_tokenize", lambda job, **kw: calls.append(("tokenize", kw["tokens_dir"])))
    monkeypatch.setattr(pl, "stage_pretrain", lambda job, **kw: calls.append(("pretrain", kw["steps"])) or pre)
    monkeypatch.setattr(pl, "stage_finetune", lambda job, p, **kw: calls.append(("finetune", p is pre)) or ft)
    monkeypatch.setattr(pl, "stage_evaluate",
                        lambda job, f, **kw: calls.append(("evaluate", f is ft, kw["retrained"])) or {"m": 1})
    monkeypatch.setattr(pl, "stage_report",
                        lambda job, m, p, f, **kw: calls.append(("report", m, "total" in job.timings)) or tmp_path / "r")
    got = pl.run_pipeline(out=tmp_path / "job", source="synthetic", pretrain_steps=7, svdb="none")
    assert got == tmp_path / "r"
    assert calls == [("data", "none"), ("tokenize", None), ("pretrain", 7), ("finetune", True),
                     ("evaluate", True, True), ("report", {"m": 1}, True)]


def test_train_only_stops_before_the_test_split_and_records_the_training(tmp_path, monkeypatch):
    """With train_only the driver trains and stops: no evaluation, no report, and training.json holds
    the stages' times and each run, kept or redone (the benchmark's budget line reads it)."""
    from hlmtune.hlm import pipeline as pl

    pre = pl.Trained([tmp_path / "p"], [100.0], [True], [0])
    ft = pl.Trained([tmp_path / "f0", tmp_path / "f1"], [200.0, None], [True, False], [0, 1])
    calls = []

    def pretrain(job, **kw):
        job.timings["pretrain"] = 100.0
        return pre

    def finetune(job, p, **kw):
        job.timings.update(finetune=None, kept_runs=1)
        return ft

    monkeypatch.setattr(pl, "stage_data", lambda job, **kw: calls.append("data"))
    monkeypatch.setattr(pl, "stage_tokenize", lambda job, **kw: calls.append("tokenize"))
    monkeypatch.setattr(pl, "stage_pretrain", pretrain)
    monkeypatch.setattr(pl, "stage_finetune", finetune)
    monkeypatch.setattr(pl, "stage_evaluate", lambda *a, **kw: calls.append("evaluate"))
    monkeypatch.setattr(pl, "stage_report", lambda *a, **kw: calls.append("report"))
    got = pl.run_pipeline(out=tmp_path / "job", source="synthetic", svdb="none", seeds=2, train_only=True)
    assert got == (tmp_path / "job").resolve() / "training.json" and calls == ["data", "tokenize"]
    record = json.loads(got.read_text())
    assert record["test_split_read"] is False
    assert record["timings"]["pretrain"] == 100.0 and record["timings"]["finetune"] is None
    assert record["timings"]["total"] >= 0
    assert record["runs"] == [
        {"stage": "pretrain", "run": str(tmp_path / "p"), "seed": 0, "seconds": 100.0, "kept": False},
        {"stage": "finetune", "run": str(tmp_path / "f0"), "seed": 0, "seconds": 200.0, "kept": False},
        {"stage": "finetune", "run": str(tmp_path / "f1"), "seed": 1, "seconds": None, "kept": True}]


def test_stage_data_alone_names_the_data_and_svdb(tmp_path, monkeypatch):
    from hlmtune.hlm import pipeline as pl

    job = pl.Job(out=tmp_path, root=tmp_path, model="hlm_1m", nproc=1, force=False)
    monkeypatch.delenv("HLM_DATA", raising=False)
    pl.stage_data(job, data=None, source="synthetic", svdb="auto")
    assert job.described.startswith("SYNTHETIC") and job.extra_db is None and job.split_file is not None
    assert set(job.lists) == {"DS1", "DS2"} and "data" in job.timings
    with pytest.raises(FileNotFoundError, match="--svdb .*no WFDB records"):
        pl.stage_data(job, data=None, source="synthetic", svdb=str(tmp_path / "empty"))


def test_stage_report_alone_writes_every_section(tmp_path):
    from hlmtune.hlm import pipeline as pl
    from hlmtune.hlm.evaluate import summarize

    classes = ["N", "S"]
    r = {**summarize([[5, 1], [0, 2]], classes), "confusion": [[5, 1], [0, 2]],
         "per_record": {"mitdb/100": {**summarize([[5, 1], [0, 2]], classes)}}}
    metrics = {"notice": "Inter-patient evaluation: stand-in", "results": {"HLM (this run)": r},
               "row_order": ["HLM (this run)"], "result": "HLM (this run)", "classes": classes}
    job = pl.Job(out=tmp_path, root=tmp_path, model="hlm_1m", nproc=2, force=False,
                 described="MIT-BIH stand-in", timings={"data": 1.0, "total": 9.0})
    empty = pl.Trained([tmp_path / "runs" / "pretrain"], [3.0], [True], [0])
    ft = pl.Trained([tmp_path / "runs" / "lora"], [4.0], [False], [0])
    path = pl.stage_report(job, metrics, empty, ft, calibration=None)
    text = path.read_text()
    assert text.startswith("**Inter-patient evaluation: stand-in**")
    for section in ("## Results on the test split", "## Beside the published inter-patient baselines",
                    "de Chazal et al. 2004", "## Per record", "| mitdb/100 |", "## Training", "## Wall time (s)",
                    "data 1 | total 9"):
        assert section in text, section
    assert json.loads((tmp_path / "report" / "timings.json").read_text()) == {"data": 1.0, "total": 9.0}


def test_a_killed_cv_or_demo_takes_its_training_stage_along(tmp_path):
    """kill -9 of the driver while a stage trains: the stage dies too (and its ranks with their launcher)."""
    from proc_utils import child_outlives_a_killed_parent

    assert not child_outlives_a_killed_parent(
        tmp_path, "from hlmtune.hlm import pipeline; pipeline._run(CMD, dict(os.environ), LOG)")
