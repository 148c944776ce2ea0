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


def test_errors_exit_2(text_data_dir: Path, tmp_path: Path, tiny_tok, capsys: pytest.CaptureFixture) -> None:
    from hlmtune.cli import main

    base = ["data-report", "--tokenizer", tiny_tok["path"], "--special-tokens-path", tiny_tok["special_tokens_path"], "--no-progress"]
    assert main(base + ["--dataset", "samsun=x.jsonl"]) == 2
    assert "did you mean 'samsum'" in capsys.readouterr().err
    hh = text_data_dir / "hh_rlhf_harmless_base_test_messages.jsonl"
    assert main(base + ["--dataset", f"hh_rlhf={hh}"]) == 2
    assert "row 86 (0-based), line 87" in capsys.readouterr().err
    assert main(base + ["--dataset", f"samsum={tmp_path / 'missing.jsonl'}"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_tokenizer_from_yaml(text_data_dir: Path, tmp_path: Path, tiny_tok, capsys: pytest.CaptureFixture) -> None:
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
    argv = ["data-report", "--tokenizer", str(cfg), "--dataset", f"slimorca={text_data_dir / 'slimorca_sample.jsonl'}",
            "--format", "csv", "--no-progress"]
    assert main(argv) == 0
    row = capsys.readouterr().out.splitlines()[1].split(",")
    assert row[-2] == "64" and int(row[-1]) == 13  # every slimorca row is longer than 64 tokens
