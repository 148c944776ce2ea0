"""Tests of data_builders/cli.py: ``hlmtune data-report``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    from hlmtune.tiny import write_tiny_tokenizer

    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_import_is_light() -> None:
    code = (
        "import sys, hlmtune.data_builders.cli as c, hlmtune.data_builders as d; "
        "heavy = [m for m in ('torch', 'torchtune', 'datasets') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dataset_names_match_registry() -> None:
    from hlmtune.data_builders import BUILDERS
    from hlmtune.data_builders.cli import DATASET_NAMES

    assert set(DATASET_NAMES) == set(BUILDERS)


def test_parse_dataset_arg() -> None:
    from hlmtune.data_builders.cli import parse_dataset_arg

    assert parse_dataset_arg("samsum") == {"name": "samsum", "split": "train"}
    assert parse_dataset_arg("grammar=/d/g.jsonl", split="test") == {
        "name": "grammar", "split": "test", "source": "json", "data_files": "/d/g.jsonl",
    }
    assert parse_dataset_arg("hh_rlhf=/d/h.parquet")["source"] == "parquet"
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 'samsum'"):
        parse_dataset_arg("samsun")
    with pytest.raises(argparse.ArgumentTypeError, match=".csv"):
        parse_dataset_arg("samsum=/d/s.csv")


def test_help_lists_every_flag(capsys: pytest.CaptureFixture) -> None:
    from hlmtune.cli import main

    with pytest.raises(SystemExit) as e:
        main(["data-report", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--dataset", "--tokenizer", "--special-tokens-path", "--max-seq-len", "--split", "--subset-size",
                 "--subset-seed", "--on-bad-row", "--format", "--output", "--json", "--no-progress"):
        assert flag in out
    # The default of --max-seq-len is stated once (not "... the tokenizer's) (default: None)").
    words = " ".join(out.split())
    max_seq_len_help = words.split("--max-seq-len MAX_SEQ_LEN ", 1)[1].split(" --split", 1)[0]
    assert max_seq_len_help.count("default:") == 1 and "the tokenizer's max_seq_len" in max_seq_len_help
    assert "(default: None)" not in max_seq_len_help


def test_end_to_end(text_data_dir: Path, tmp_path: Path, tiny_tok, capsys: pytest.CaptureFixture) -> None:
    from hlmtune.cli import main
    from hlmtune.data_builders import token_count_report

    json_path = tmp_path / "report.json"
    argv = [
        "data-report",
        "--tokenizer", tiny_tok["path"],
        "--special-tokens-path", tiny_tok["special_tokens_path"],
        "--max-seq-len", "512",
        "--dataset", f"samsum={text_data_dir / 'samsum.jsonl'}",
        "--dataset", f"slimorca={text_data_dir / 'slimorca_sample.jsonl'}",
        "--dataset", f"hh_rlhf={text_data_dir / 'hh_rlhf_harmless_base_test_messages.jsonl'}",
        "--subset-size", "13",
        "--on-bad-row", "skip",
        "--json", str(json_path),
        "--no-progress",
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| dataset | template |") and len(table) == 2 + 4
    data = json.loads(json_path.read_text())
    assert [(r["dataset"], r["template"], r["rows"]) for r in data["rows"]] == [
        ("samsum", "summarize", 13), ("slimorca", "chat", 13),
        ("hh_rlhf", "chat (chosen)", 13), ("hh_rlhf", "chat (rejected)", 13),
    ]
    direct = token_count_report(
        datasets=[{"name": "samsum", "source": "json", "data_files": str(text_data_dir / "samsum.jsonl")}],
        tokenizer=tiny_tok["path"], special_tokens_path=tiny_tok["special_tokens_path"], max_seq_len=512,
        subset_size=13, progress=False,
    )
    assert data["rows"][0] == json.loads(json.dumps(direct[0]))

    csv_path = tmp_path / "report.csv"
    assert main(argv[:9] + ["--format", "csv", "--output", str(csv_path), "--no-progress", "--subset-size", "5"]) == 0
    assert csv_path.read_text().splitlines()[0].startswith("dataset,template,source,rows")


def test_errors_exit_2(real_text_data_dir: Path, tmp_path: Path, tiny_tok, capsys: pytest.CaptureFixture) -> None:
    from hlmtune.cli import main

    base = ["data-report", "--tokenizer", tiny_tok["path"], "--special-tokens-path", tiny_tok["special_tokens_path"], "--no-progress"]
    assert main(base + ["--dataset", "samsun=x.jsonl"]) == 2
    assert "did you mean 'samsum'" in capsys.readouterr().err
    hh = real_text_data_dir / "hh_rlhf_harmless_base_test_messages.jsonl"
    assert main(base + ["--dataset", f"hh_rlhf={hh}"]) == 2
    assert "row 86 (0-based), line 87" in capsys.readouterr().err
    assert main(base + ["--dataset", f"samsum={tmp_path / 'missing.jsonl'}"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_tokenizer_from_yaml(real_text_data_dir: Path, tmp_path: Path, tiny_tok, capsys: pytest.CaptureFixture) -> None:
    import yaml

    from hlmtune.cli import main

    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(yaml.safe_dump({
        "tokenizer": {
            "_component_": "torchtune.models.llama3.llama3_tokenizer",
            "path": tiny_tok["path"],
            "special_tokens_path": tiny_tok["special_tokens_path"],
            "max_seq_len": 64,
        }
    }))
    argv = ["data-report", "--tokenizer", str(cfg), "--dataset", f"slimorca={real_text_data_dir / 'slimorca_sample.jsonl'}",
            "--format", "csv", "--no-progress"]
    assert main(argv) == 0
    row = capsys.readouterr().out.splitlines()[1].split(",")
    assert row[-2] == "64" and int(row[-1]) == 13  # every slimorca row is longer than 64 tokens


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_row_keeps_finished_datasets_and_names_the_flag(tmp_path: Path, tiny_tok, capsys: pytest.CaptureFixture) -> None:
    """A bad row in one dataset must not throw away the datasets already counted."""
    from hlmtune.cli import main

    samsum = _write_jsonl(tmp_path / "samsum.jsonl", [
        {"id": str(i), "dialogue": f"A: hello {i}\r\nB: hi", "summary": f"A greets B {i}."} for i in range(3)])
    turns = [{"role": "user", "content": "where is it?"}, {"role": "assistant", "content": "here"}]
    empty_end = turns[:1] + [{"role": "assistant", "content": ""}]  # HH-RLHF line 87 has this
    hh = _write_jsonl(tmp_path / "hh.jsonl", [{"chosen": turns, "rejected": turns},
                                              {"chosen": empty_end, "rejected": turns}])
    out_json = tmp_path / "report.json"
    argv = ["data-report", "--tokenizer", tiny_tok["path"], "--special-tokens-path", tiny_tok["special_tokens_path"],
            "--dataset", f"samsum={samsum}", "--dataset", f"hh_rlhf={hh}", "--json", str(out_json), "--no-progress"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "| samsum | summarize |" in out and "hh_rlhf" in out.split("|---")[-1]  # the table, then the failure
    assert f"{hh} row 1 (0-based), line 2" in err and "--on-bad-row skip" in err and "on_bad_row=" not in err
    data = json.loads(out_json.read_text())
    assert [r["dataset"] for r in data["rows"]] == ["samsum"] and data["failed"][0]["dataset"] == "hh_rlhf"
    assert main(argv + ["--on-bad-row", "skip"]) == 0
    assert "failed" not in json.loads(out_json.read_text())


def test_tokenizer_from_a_pack_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--tokenizer tiny_lora` (a pack config: its tokenizer paths interpolate model_dir)."""
    import shutil

    from hlmtune.cli import main
    from hlmtune.registry import config_path
    from hlmtune.tiny import write_tiny_tokenizer

    model = tmp_path / "model"
    write_tiny_tokenizer(model / "original")
    samsum = _write_jsonl(tmp_path / "samsum.jsonl", [{"id": "1", "dialogue": "A: hi\r\nB: hello", "summary": "Greetings."}])
    base = ["data-report", "--dataset", f"samsum={samsum}", "--format", "csv", "--no-progress"]
    cfg = tmp_path / "tiny_lora.yaml"
    shutil.copy(config_path("tiny_lora"), cfg)
    for tok in ("tiny_lora", str(cfg)):
        assert main(base + ["--tokenizer", tok, "--set", f"model_dir={model}"]) == 0, capsys.readouterr().err
        row = capsys.readouterr().out.splitlines()[1].split(",")
        assert row[0] == "samsum" and row[-2] == "256"  # the config's tokenizer.max_seq_len
    assert main(base + ["--tokenizer", str(cfg), "--set", f"model_dir={tmp_path / 'nowhere'}"]) == 2
    err = capsys.readouterr().err
    assert f"tokenizer.path {tmp_path / 'nowhere'}/original/tokenizer.model does not exist" in err
    assert "--set model_dir=" in err and len(err.strip().splitlines()) == 1
    cfg.write_text("tokenizer:\n  _component_: torchtune.models.llama3.llama3_tokenizer\n  path: ${model_dir}/t.model\n")
    assert main(base + ["--tokenizer", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.path needs 'model_dir'" in err and "--set model_dir=" in err


def test_wrong_schema_names_dataset_once_and_the_file_row(tmp_path: Path, tiny_tok, capsys: pytest.CaptureFixture) -> None:
    """A grammar file given as samsum with --subset-size: one prefix, the file's row, no empty table."""
    import numpy as np

    from hlmtune.cli import main

    wrong = _write_jsonl(tmp_path / "wrong.jsonl", [{"input": f"a {i}", "output": f"b {i}"} for i in range(30)])
    argv = ["data-report", "--tokenizer", tiny_tok["path"], "--special-tokens-path", tiny_tok["special_tokens_path"],
            "--dataset", f"samsum={wrong}", "--subset-size", "5", "--no-progress"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("samsum: ") == 1 and err.startswith(f"hlmtune data-report: error: samsum: {wrong} row ")
    first = int(np.random.default_rng(0).permutation(30)[0])  # the subset's first visited row, bad like all
    assert f"{wrong} row {first} (0-based), line {first + 1}: field 'dialogue' is missing" in err
    assert "'line' is the file's 1-based line" in err and "--subset-size 5 checks rows in a seeded random order" in err
    assert out.startswith("Incomplete: samsum failed (") and "| dataset |" not in out and "|---" not in out
    assert out.count("samsum") == 1


def test_bad_json_file_one_error_line(tmp_path: Path, tiny_tok) -> None:
    """Run as a user does: only our error line on stderr (no datasets/pyarrow ERROR: records)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "dialogue": "A: hi", "summary": "x"}\n{"id": "2", "dialogue": "A: hi}\n')
    argv = [sys.executable, "-m", "hlmtune.data_builders.cli", "--tokenizer", tiny_tok["path"],
            "--special-tokens-path", tiny_tok["special_tokens_path"], "--dataset", f"samsum={bad}", "--no-progress"]
    res = subprocess.run(argv, capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert "ERROR:" not in res.stderr + res.stdout and "Failed to load JSON" not in res.stderr + res.stdout
    assert res.stderr.strip().splitlines() == [
        f"hlmtune data-report: error: samsum: {bad} row 1 (0-based), line 2: not valid JSON "
        "(Unterminated string starting at: column 25) (rerun with --on-bad-row skip to skip and count bad rows)"
    ]
    assert "at at" not in res.stderr and res.stdout.startswith("Incomplete: samsum failed (")
