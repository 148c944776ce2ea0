"""``hlmtune tokenize / download / synth-ecg`` through the real CLI entry point."""

from __future__ import annotations

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


def test_synth_then_tokenize_and_resume(tmp_path, capsys):
    assert main(["synth-ecg", "--out", str(tmp_path / "db"), "--n-records", "2", "--duration", "20"]) == 0
    args = ["tokenize", "--records", str(tmp_path / "db"), "--out", str(tmp_path / "out"), "--scheme", "samples",
            "--window", "256", "--workers", "2", "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tokenized 2 records, skipped 0 already done, failed 0" in out
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["params"]["window"] == 256 and m["totals"]["records"] == 2
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
    assert "FAILED records:\n  101: annotation file 101.atr is missing" in out


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["tokenize", "--records", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "records directory" in capsys.readouterr().err
    assert main(["tokenize", "--records", str(tmp_path), "--out", str(tmp_path / "o"), "--window", "64"]) == 2
    assert "window must be 128..1024" in capsys.readouterr().err


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
