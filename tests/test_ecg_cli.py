"""``hlmtune tokenize / download / synth-ecg`` through the real CLI entry point."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from hlmtune.cli import build_parser, main

TOKENIZE_FLAGS = [
    "--records", "--out", "--records-list", "--workers", "--sampto", "--no-progress", "--implementation",
    "--scheme", "--window", "--target-rate", "--label-mode", "--quantization", "--levels", "--amplitude-mv",
    "--mu", "--rr-bins", "--rr-min", "--rr-max", "--lead", "--lead-fallback", "--annotation-ext",
    "--no-annotations", "--detector", "--detector-check", "--on-missing-annotations", "--on-unknown-symbols",
]


def _help(cmd):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[cmd]


@pytest.mark.parametrize("cmd", ["tokenize", "download", "synth-ecg"])
def test_help_explains_every_flag_with_defaults(cmd):
    p = _help(cmd)
    text = " ".join(p.format_help().split())  # unwrap
    for a in p._actions:
        if a.option_strings and a.dest != "help":
            assert a.help and len(a.help) > 10, a.dest
            if not a.required and a.default not in (None, False):
                assert "default" in a.help or f"(default: {a.default})" in text, a.dest
    if cmd == "tokenize":
        for f in TOKENIZE_FLAGS:
            assert f in text, f
        assert "(default: 128)" in text and "(default: samples)" in text and "(default: MLII)" in text


def test_cli_module_imports_no_heavy_libraries():
    code = ("import sys, hlmtune.ecg_tokenizer.cli; "
            "print(any(m in sys.modules for m in ('torch', 'numpy', 'scipy', 'wfdb')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_download_offline_fails_fast_and_clearly(tmp_path, monkeypatch, capsys):
    import requests
    import wfdb

    calls = []

    def offline(db_dir, dl_dir, records="all", **kw):  # what wfdb raises with no network
        calls.append((db_dir, dl_dir, records))
        raise requests.exceptions.ConnectionError(
            "HTTPSConnectionPool(host='physionet.org', port=443): Max retries exceeded with url: /content/mitdb/"
        )

    monkeypatch.setattr(wfdb, "dl_database", offline)
    rc = main(["download", "mitdb", "--out", str(tmp_path / "mitdb")])
    err = capsys.readouterr().err
    assert rc == 1 and calls == [("mitdb", str(tmp_path / "mitdb"), "all")]
    assert "hlmtune download mitdb: cannot download from PhysioNet" in err
    assert "needs internet access" in err and "ConnectionError" in err


@pytest.mark.parametrize("database", ["svdb", "incartdb"])
def test_download_names_the_database_to_wfdb(tmp_path, monkeypatch, capsys, database):
    """The extra training patients (svdb) and a database of patients nothing trains on (INCART,
    for eval --test-records) are PhysioNet's names, handed to wfdb as they are."""
    import wfdb

    calls = []
    monkeypatch.setattr(wfdb, "dl_database", lambda db_dir, dl_dir, records="all", **kw: calls.append((db_dir, records)))
    assert main(["download", database, "--out", str(tmp_path / database), "--record", "I01"]) == 0
    assert calls == [(database, ["I01"])] and f"downloaded {database} into" in capsys.readouterr().out


def test_synth_then_tokenize_and_resume(tmp_path, capsys):
    assert main(["synth-ecg", "--out", str(tmp_path / "db"), "--n-records", "2", "--duration", "20"]) == 0
    args = ["tokenize", "--records", str(tmp_path / "db"), "--out", str(tmp_path / "out"), "--scheme", "samples",
            "--window", "256", "--workers", "2", "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tokenized 2 records, skipped 0 already done, failed 0" in out
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["params"]["window"] == 256 and m["totals"]["records"] == 2
    # Record s000 has an AF episode: the summary names rhythms without MIT-BIH's "(",
    # the manifest keeps the WFDB aux_note strings.
    counts = m["totals"]["rhythm_counts"]
    assert set(counts) == {"(N", "(AFIB"}, counts
    line = next(ln for ln in out.splitlines() if ln.startswith("rhythms (beats): "))
    assert line == "rhythms (beats): " + ", ".join(f"{k[1:]} {v}" for k, v in counts.items()), line
    assert "(" not in line.split(": ", 1)[1], line
    assert main(args) == 0 and "tokenized 0 records, skipped 2 already done" in capsys.readouterr().out


def test_failed_record_gives_exit_status_1(mitdb_dir, tmp_path, capsys):
    db = tmp_path / "db"
    db.mkdir()
    for n in ("100", "101"):
        for ext in ("hea", "dat", "atr"):
            shutil.copyfile(mitdb_dir / f"{n}.{ext}", db / f"{n}.{ext}")
    (db / "101.atr").unlink()
    (tmp_path / "list.txt").write_text("100\n101\n")
    rc = main(["tokenize", "--records", str(db), "--out", str(tmp_path / "out"), "--scheme", "annotation",
               "--records-list", str(tmp_path / "list.txt"), "--on-missing-annotations", "error",
               "--sampto", "36000", "--workers", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED records:\n  db/101: annotation file 101.atr is missing" in out  # ids carry the database


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["tokenize", "--records", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "records directory" in capsys.readouterr().err
    assert main(["tokenize", "--records", str(tmp_path), "--out", str(tmp_path / "o"), "--window", "64"]) == 2
    assert "--beat-samples must be 128..1024" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--beat-samples", "5000"], "--beat-samples must be 128..1024 samples, got 5000"),
    (["--window", "64"], "--beat-samples must be 128..1024 samples, got 64"),
    (["--target-rate", "-5"], "--target-rate must be a finite number > 0, got -5.0"),
    (["--target-rate", "inf"], "--target-rate must be a finite number > 0, got inf"),
    (["--amplitude-mv", "0"], "--amplitude-mv must be a finite number > 0, got 0.0"),
    (["--mu", "-1"], "--mu must be a finite number > 0, got -1.0"),
    (["--levels", "1"], "--levels must be 2..65536, got 1"),
    (["--rr-bins", "300"], "--rr-bins must be 0..256, got 300"),
    (["--rr-min", "3"], "need 0 <= --rr-min < --rr-max, got 3.0, 2.0"),
])
def test_tokenize_bad_number_names_the_flag_exit_2(tmp_path, capsys, argv, message):
    rc = main(["tokenize", "--records", str(tmp_path), "--out", str(tmp_path / "o"), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"hlmtune tokenize: error: {message}\n", err
    assert not (tmp_path / "o").exists()


def test_tokenize_flag_names_cover_every_parameter():
    from hlmtune.ecg_tokenizer import cli
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    assert set(cli._PARAM_FLAGS) == {f.name for f in dataclasses.fields(TokenizerParams)}
    flags = {o for a in _help("tokenize")._actions for o in a.option_strings}
    assert set(cli._PARAM_FLAGS.values()) <= flags
    # Python callers still get the parameter's own name.
    with pytest.raises(ValueError, match=r"^target_rate must be a finite number > 0, got -5$"):
        TokenizerParams(target_rate=-5)

def test_summary_prints_rhythm_names_without_the_annotation_paren(tmp_path):
    from hlmtune.ecg_tokenizer.pipeline import RunSummary

    s = RunSummary(out_dir=tmp_path, manifest={"totals": {"rhythm_counts": {"(N": 5, "(AFIB": 2, "(unknown)": 1}}})
    assert "rhythms (beats): N 5, AFIB 2, unknown 1" in s.format().splitlines()


def test_tokenize_help_examples_use_beat_samples():
    epilog = _help("tokenize").epilog
    assert "--scheme samples --beat-samples 128 --out" in epilog
    assert "--window" not in epilog


@pytest.mark.parametrize("argv, message", [
    (["--fs", "0"], "--fs must be an integer >= 60 (Hz), got 0"),
    (["--fs", "-360"], "--fs must be an integer >= 60 (Hz), got -360"),
    (["--fs", "59"], "--fs must be an integer >= 60 (Hz), got 59"),
    (["--n-records", "0"], "--n-records must be an integer >= 1, got 0"),
    (["--duration", "4"], "--duration must be a finite number >= 5 (seconds), got 4.0"),
    (["--duration", "inf"], "--duration must be a finite number >= 5 (seconds), got inf"),
])
def test_synth_out_of_range_flag_is_one_line_exit_2(tmp_path, capsys, argv, message):
    assert main(["synth-ecg", "--out", str(tmp_path / "d"), *argv]) == 2
    assert capsys.readouterr().err == f"hlmtune synth-ecg: error: {message}\n"
    assert not (tmp_path / "d").exists()


def test_synth_lowest_fs_tokenizes_with_detector(tmp_path, capsys):
    from hlmtune.ecg_tokenizer.cli import SYNTH_MIN_FS

    db = tmp_path / "db"
    assert main(["synth-ecg", "--out", str(db), "--n-records", "1", "--duration", "10", "--fs", str(SYNTH_MIN_FS)]) == 0
    assert main(["tokenize", "--records", str(db), "--out", str(tmp_path / "o"), "--detector-check",
                 "--workers", "1", "--no-progress"]) == 0
    assert "detector vs annotations" in capsys.readouterr().out


@pytest.mark.parametrize("below", [False, True], ids=["out-is-file", "out-under-file"])
def test_output_path_that_is_a_file_is_one_line_exit_2(tmp_path, capsys, below):
    taken = tmp_path / "taken"
    taken.write_text("x")
    out = taken / "sub" if below else taken
    synth = tmp_path / "synth"
    assert main(["synth-ecg", "--out", str(synth), "--n-records", "1", "--duration", "10"]) == 0
    capsys.readouterr()
    for argv in (["tokenize", "--records", str(synth), "--out", str(out), "--no-progress", "--workers", "1"],
                 ["synth-ecg", "--out", str(out), "--n-records", "1", "--duration", "10"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"--out {out}: " in err and "not a directory" in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert taken.read_text() == "x"
