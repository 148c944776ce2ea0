"""Directory runs: good records finish, bad ones are listed with reasons, reruns resume,
outputs are byte-identical across runs and worker counts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hlm_fixtures import svdb_style_folder
from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
from hlmtune.ecg_tokenizer.vocab import TokenizerParams

GOOD = ["100", "119", "201"]
OPTS = RecordOptions(sampto=360 * 45)
P = TokenizerParams()


def _copy(src: Path, name: str, dst: Path) -> None:
    for ext in ("hea", "dat", "atr"):
        shutil.copyfile(src / f"{name}.{ext}", dst / f"{name}.{ext}")


@pytest.fixture()
def db(mitdb_dir, tmp_path):
    d = tmp_path / "db"
    d.mkdir()
    for n in GOOD + ["101", "103", "105"]:
        _copy(mitdb_dir, n, d)
    raw = (d / "101.dat").read_bytes()
    (d / "101.dat").write_bytes(raw[:1000])  # truncated
    (d / "105.dat").unlink()  # missing
    b = bytearray((d / "103.atr").read_bytes())  # an undefined annotation code
    w = np.frombuffer(bytes(b), dtype="<u2")
    i = int(np.flatnonzero((w >> 10) == 1)[0])
    b[2 * i : 2 * i + 2] = ((int(w[i]) & 0x3FF) | (45 << 10)).to_bytes(2, "little")
    (d / "103.atr").write_bytes(bytes(b))
    return d


def _files(out: Path):
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_directory_run_resume_and_determinism(db, mitdb_dir, tmp_path):
    out = tmp_path / "out"
    s = tokenize_directory(db, out, params=P, options=OPTS, workers=2, progress=False)
    assert not s.ok and s.done == GOOD and s.skipped == []
    reasons = {f["record"]: f["reason"] for f in s.failed}
    assert set(reasons) == {"101", "103", "105"}
    assert reasons["101"].startswith("signal file 101.dat is truncated: 1000 bytes")
    assert reasons["103"].startswith("unknown annotation code")
    assert reasons["105"].startswith("signal file 105.dat is missing")
    m = json.loads((out / "manifest.json").read_text())
    assert [r["record"] for r in m["records"]] == GOOD
    assert m["failed"] == [{"record": k, "reason": reasons[k]} for k in sorted(reasons)]
    assert "FAILED records:" in s.format() and "101: signal file 101.dat is truncated" in s.format()
    first = _files(out)

    # Rerun: finished records are skipped, failures reported again, bytes unchanged.
    s2 = tokenize_directory(db, out, params=P, options=OPTS, workers=1, progress=False)
    assert s2.done == [] and s2.skipped == GOOD and len(s2.failed) == 3
    assert _files(out) == first

    # One worker into a fresh directory: byte-identical outputs (manifest included).
    out1 = tmp_path / "out1"
    tokenize_directory(db, out1, params=P, options=OPTS, workers=1, progress=False)
    assert _files(out1) == first

    # Damage: a lost done marker and a truncated shard are redone; a stray temp file is ignored.
    (out / "records" / "100.json").unlink()
    tok = out / "records" / "119.tokens.npy"
    tok.write_bytes(tok.read_bytes()[:-10])
    (out / "records" / ".201.tokens.npy.tmp.999").write_bytes(b"partial")
    s3 = tokenize_directory(db, out, params=P, options=OPTS, workers=1, progress=False)
    assert s3.done == ["100", "119"] and s3.skipped == ["201"]
    (out / "records" / ".201.tokens.npy.tmp.999").unlink()
    assert _files(out) == first

    # Repair two bad records: only they are tokenized now; 105 still fails.
    for n in ("101", "103"):
        _copy(mitdb_dir, n, db)
    s4 = tokenize_directory(db, out, params=P, options=OPTS, workers=2, progress=False)
    assert s4.done == ["101", "103"] and s4.skipped == GOOD and [f["record"] for f in s4.failed] == ["105"]


def test_changed_parameters_or_inputs_redo(db, tmp_path):
    out = tmp_path / "out"
    tokenize_directory(db, out, params=P, options=OPTS, records=["100"], progress=False)
    s = tokenize_directory(db, out, params=TokenizerParams(levels=128), options=OPTS, records=["100"], progress=False)
    assert s.done == ["100"]
    s = tokenize_directory(db, out, params=TokenizerParams(levels=128), options=OPTS, records=["100"], progress=False)
    assert s.skipped == ["100"]
    with open(db / "100.hea", "a") as f:  # an input changed: its sha256 no longer matches the marker
        f.write("# edited\n")
    s = tokenize_directory(db, out, params=TokenizerParams(levels=128), options=OPTS, records=["100"], progress=False)
    assert s.done == ["100"]


def test_reference_implementation_same_bytes(db, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    opts = RecordOptions(sampto=360 * 20)
    tokenize_directory(db, a, params=P, options=opts, records=["119"], progress=False)
    tokenize_directory(db, b, params=P, options=opts, records=["119"], progress=False, implementation="reference")
    assert _files(a) == _files(b)


def test_detector_run_reports_se_ppv(db, tmp_path):
    out = tmp_path / "out"
    opts = RecordOptions(sampto=360 * 60, use_annotations=False)
    s = tokenize_directory(db, out, params=TokenizerParams(scheme="annotation"), options=opts,
                           records=["100", "119"], progress=False)
    det = s.manifest["totals"]["detector"]
    assert det["records"] == 2 and det["sensitivity"] > 0.97 and det["positive_predictivity"] > 0.97
    assert all(r["beat_source"] == "detector" for r in s.manifest["records"])
    assert s.manifest["totals"]["label_counts"].keys() == {"<unlabeled>"}
    assert "detector vs annotations (150 ms window, 2 records): Se" in s.format()


def test_interrupted_run_leaves_no_manifest(db, tmp_path, monkeypatch):
    out = tmp_path / "out"
    tokenize_directory(db, out, params=P, options=OPTS, records=GOOD, progress=False)
    assert (out / "manifest.json").exists()
    import hlmtune.ecg_tokenizer.core as core

    real, calls = core.tokenize_record, []

    def dies_on_second(rec, params):
        calls.append(rec.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(rec, params)

    monkeypatch.setattr(core, "tokenize_record", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        tokenize_directory(db, out, params=TokenizerParams(levels=64), options=OPTS, records=GOOD, progress=False)
    assert not (out / "manifest.json").exists()  # nothing looks done
    monkeypatch.setattr(core, "tokenize_record", real)
    s = tokenize_directory(db, out, params=TokenizerParams(levels=64), options=OPTS, records=GOOD, progress=False)
    assert s.ok and len(s.done) == 2 and len(s.skipped) == 1  # the record finished before the crash is kept


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_workers_die_with_a_killed_parent(tmp_path):
    """SIGKILL of `hlmtune tokenize` (no cleanup runs) must not leave its forked workers behind."""
    import signal
    import subprocess
    import sys
    import time

    from proc_utils import alive, children

    # Workers that take long over each record, so they are alive when the parent is killed.
    script = (
        "import time\n"
        "from hlmtune.ecg_tokenizer import pipeline\n"
        "from hlmtune.ecg_tokenizer.vocab import TokenizerParams\n"
        "def slow(task):\n"
        "    time.sleep(120)\n"
        "pipeline._compute = slow\n"
        f"pipeline.tokenize_directory({str(tmp_path)!r}, {str(tmp_path / 'out')!r}, params=TokenizerParams(),\n"
        "    records=['a', 'b', 'c', 'd'], workers=2, progress=False)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 60
        workers = []
        while len(workers) < 2 and time.time() < deadline:
            time.sleep(0.2)
            workers = children(proc.pid)
        assert len(workers) >= 2, "the pool did not start"
        time.sleep(0.5)  # let the workers reach their task
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while any(alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.1)
        survivors = [w for w in workers if alive(w)]
        for w in survivors:  # clean up before failing
            os.kill(w, signal.SIGKILL)
        assert not survivors, f"workers {survivors} outlived their parent"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_two_databases_one_shard_set_ids_never_collide(mitdb_dir, tmp_path):
    """A record name both databases hold stays two records; svdb-style input tokenizes at 128 Hz."""
    from hlmtune.ecg_tokenizer.pipeline import RecordSource, tokenize_sources
    from hlmtune.ecg_tokenizer.splits import match_records

    a = tmp_path / "mitdb"
    a.mkdir()
    for n in ("100", "101"):
        _copy(mitdb_dir, n, a)
    b = svdb_style_folder(tmp_path / "svdb", names=("100", "800"))  # "100" in both databases
    params = TokenizerParams()
    s = tokenize_sources([RecordSource(a, "mitdb"), RecordSource(b, "svdb")], tmp_path / "out", params=params,
                         progress=False)
    assert s.ok, s.format()
    recs = {r["record"]: r for r in s.manifest["records"]}
    assert sorted(recs) == ["mitdb/100", "mitdb/101", "svdb/100", "svdb/800"]
    assert recs["mitdb/100"]["outputs"]["tokens"]["sha256"] != recs["svdb/100"]["outputs"]["tokens"]["sha256"]
    sv = recs["svdb/800"]
    assert sv["fs"] == 128.0 and sv["lead"] == "ECG1" and any("MLII absent" in n for n in sv["notes"])
    # the annotation past the end is dropped and counted; the record's other beats are kept
    assert [d["reason"] for d in sv["dropped"] if "outside the signal" in d["reason"]] == [
        "annotation outside the signal (7680 samples)"]
    assert sv["n_beats"] >= sv["annotated_beats"] - sv["n_dropped"] > 50
    # names: exact ids, a database's own name when only one database has it, else an error
    ids = list(recs)
    assert match_records(["svdb/100", "800", "101"], ids) == ["svdb/100", "svdb/800", "mitdb/101"]
    with pytest.raises(ValueError, match=r"'100' is in several databases .*mitdb/100, svdb/100"):
        match_records(["100"], ids)
    # a second call with one database keeps the other's records in the manifest
    s2 = tokenize_sources([RecordSource(b, "svdb")], tmp_path / "out", params=params, progress=False)
    assert sorted(r["record"] for r in s2.manifest["records"]) == sorted(ids) and s2.skipped == ["svdb/100", "svdb/800"]


def test_several_folders_need_names(mitdb_dir, tmp_path):
    from hlmtune.ecg_tokenizer.pipeline import RecordSource, tokenize_sources

    with pytest.raises(ValueError, match="need a database name each"):
        tokenize_sources([RecordSource(mitdb_dir), RecordSource(mitdb_dir, "x")], tmp_path, params=TokenizerParams())
    with pytest.raises(ValueError, match="database names must differ"):
        tokenize_sources([RecordSource(mitdb_dir, "x"), RecordSource(mitdb_dir, "x")], tmp_path, params=TokenizerParams())


def test_cli_tokenizes_several_folders_into_one_set(mitdb_dir, tmp_path, hlmtune_cli):
    import subprocess

    a = tmp_path / "mitdb"
    a.mkdir()
    _copy(mitdb_dir, "100", a)
    b = svdb_style_folder(tmp_path / "supraventricular", names=("800",), seconds=30)
    out = tmp_path / "tok"
    proc = subprocess.run([hlmtune_cli, "tokenize", "--records", str(a), f"svdb={b}", "--out", str(out),
                           "--no-progress", "--workers", "1"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert [r["record"] for r in m["records"]] == ["mitdb/100", "svdb/800"]
    assert (out / "records" / "svdb__800.tokens.npy").is_file()
    bad = subprocess.run([hlmtune_cli, "tokenize", "--records", str(a), str(b), "--records-list", str(a / "RECORDS"),
                          "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and "one --records folder" in bad.stderr


def test_second_lead_shards(db, tmp_path, hlmtune_cli):
    """``second_lead``: a ``lead2`` output per record (hashed, verified, resumed like the others),
    the lead named in the record's metadata and the manifest; the stream, the beat table and the
    run digest of a run without it are unchanged (``hlmtune tokenize --second-lead``)."""
    from hlmtune.ecg_tokenizer.shards import ShardError, read_manifest, verify_shards

    plain, two = tmp_path / "plain", tmp_path / "two"
    tokenize_directory(db, plain, params=P, options=OPTS, records=GOOD, progress=False)
    assert "second_lead" not in json.loads((plain / "manifest.json").read_text())["options"]  # older shards' digest kept
    import subprocess

    import wfdb

    cmd = [hlmtune_cli, "tokenize", "--records", str(db), "--records-list", str(_list(tmp_path, GOOD)),
           "--out", str(two), "--sampto", str(360 * 45), "--second-lead", "--no-progress", "--workers", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = read_manifest(two)
    assert m["options"]["second_lead"] is True
    for rec, old in zip(m["records"], read_manifest(plain)["records"]):
        assert rec["lead2"] == wfdb.rdheader(str(db / rec["record"].split("/")[-1])).sig_name[1] and rec["outputs"]["lead2"]["shape"] == [rec["n_beats"], P.window]
        assert {k: rec["outputs"][k]["sha256"] for k in ("tokens", "beats")} == \
            {k: old["outputs"][k]["sha256"] for k in ("tokens", "beats")}
        arr = np.load(two / rec["outputs"]["lead2"]["file"])
        lay = m["vocab"]["layout"]
        assert arr.dtype.str == m["token_dtype"] and lay["sample_base"] <= arr.min() and arr.max() < lay["rhythm_base"]
    assert verify_shards(two) == []
    assert "tokenized 0 records, skipped 3 already done" in subprocess.run(cmd, capture_output=True, text=True).stdout
    f = two / m["records"][0]["outputs"]["lead2"]["file"]
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(ShardError, match="lead2.npy"):
        read_manifest(two)
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert "tokenized 1 records, skipped 2 already done" in r.stdout and verify_shards(two) == []


def _list(tmp_path: Path, names) -> Path:
    p = tmp_path / "list.txt"
    p.write_text("\n".join(names) + "\n")
    return p
