"""CLI registration: commands exist, --help documents every flag, no torch at import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hlmtune.cli import build_parser


def test_registration_imports_no_torch() -> None:
    code = "import sys, hlmtune.profiling.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


@pytest.mark.parametrize("argv, flags", [
    (["collect"], ["--out", "--warmup-steps", "--include-partial", "--work-tolerance", "--no-plots"]),
    (["profile", "nsys"], ["--out", "--window-s", "--delay-s", "--trace", "--stop-app", "--dry-run"]),
    (["profile", "torch"], ["--out", "--window-s", "--top"]),
    (["profile", "parse"], ["--out"]),
])
def test_help_lists_every_flag(argv, flags, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv + ["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for f in flags:
        assert f in text


def test_profile_without_command_is_an_error(capsys: pytest.CaptureFixture) -> None:
    from hlmtune.cli import main

    assert main(["profile", "nsys", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "after `--`" in err and err.startswith("hlmtune profile nsys: error: ")  # names the command, as others do
    assert main(["profile", "torch"]) == 2
    assert capsys.readouterr().err.startswith("hlmtune profile torch: error: ")


def test_profile_parse_of_a_missing_path_names_the_command(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from hlmtune.cli import main

    assert main(["profile", "parse", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hlmtune profile parse: error: ") and str(tmp_path / "nope") in err


def test_collect_into_a_file_is_one_line_exit_2(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from hlmtune.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "steps.jsonl").write_text('{"step": 1, "iteration_time_s": 0.5}\n')
    taken = tmp_path / "taken"
    taken.write_text("x")
    assert main(["collect", str(run), "--out", str(taken), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"--out {taken}: is a file, not a directory" in err and "Traceback" not in err
    assert taken.read_text() == "x"
