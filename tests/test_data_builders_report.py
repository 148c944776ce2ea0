"""Tests of data_builders/report.py: numbers against a direct computation."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    from hlmtune.tiny import write_tiny_tokenizer

    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tiny_tok):
    from torchtune.models.llama3 import llama3_tokenizer

    return llama3_tokenizer(tiny_tok["path"], special_tokens_path=tiny_tok["special_tokens_path"], max_seq_len=256)


@pytest.fixture(scope="session")
def small_files(real_text_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """First 200 rows of grammar and samsum (whole files for the tiny ones) to keep this fast."""
    out = tmp_path_factory.mktemp("small")
    files = {}
    for name, src, n in (
        ("grammar", "grammar_c4_200m.jsonl", 200),
        ("samsum", "samsum.jsonl", 200),
        ("stack_exchange_paired", "stack_exchange_paired_tiny.jsonl", 25),
    ):
        with open(real_text_data_dir / src, encoding="utf-8") as f:
            lines = [next(f) for _ in range(n)]
        files[name] = out / src
        files[name].write_text("".join(lines), encoding="utf-8")
    return files


def _rows(path: Path) -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _direct(tokenizer, conversations, limit: int) -> Dict[str, Any]:
    """Tokenize hand-built messages with an untruncated tokenizer and compute the statistics
    with numpy (p90 by numpy's inverted-CDF method, the nearest-rank definition)."""
    from torchtune.models.llama3 import Llama3Tokenizer

    assert isinstance(tokenizer, Llama3Tokenizer)
    lengths, targets = [], []
    saved = tokenizer.max_seq_len
    tokenizer.max_seq_len = None
    try:
        for messages in conversations:
            tokens, mask = tokenizer.tokenize_messages(messages)
            lengths.append(len(tokens))
            targets.append(sum(1 for m in mask if not m))
    finally:
        tokenizer.max_seq_len = saved
    lengths_a, targets_a = np.array(lengths), np.array(targets)
    return {
        "rows": len(lengths),
        "tokens_total": int(lengths_a.sum()),
        "tokens_mean": float(lengths_a.mean()),
        "tokens_median": float(np.median(lengths_a)),
        "tokens_p90": int(np.percentile(lengths_a, 90, method="inverted_cdf")),
        "tokens_max": int(lengths_a.max()),
        "prompt_tokens_total": int((lengths_a - targets_a).sum()),
        "target_tokens_total": int(targets_a.sum()),
        "target_tokens_mean": float(targets_a.mean()),
        "truncated_rows": int((lengths_a > limit).sum()),
    }


def _assert_matches(row: Dict[str, Any], expected: Dict[str, Any]) -> None:
    for key, value in expected.items():
        assert row[key] == pytest.approx(value), key


def test_report_matches_direct_computation(small_files, tokenizer) -> None:
    from torchtune.data import Message

    from hlmtune.data_builders import token_count_report

    report = token_count_report(
        datasets=[
            {"name": "grammar", "source": "json", "data_files": str(small_files["grammar"])},
            {"_component_": "hlmtune.data_builders.samsum_dataset", "source": "json", "data_files": str(small_files["samsum"])},
            {"name": "stack_exchange_paired", "source": "json", "data_files": str(small_files["stack_exchange_paired"])},
        ],
        tokenizer=tokenizer,
        progress=False,
    )
    assert [(r["dataset"], r["template"]) for r in report] == [
        ("grammar", "grammar_error_correction"),
        ("samsum", "summarize"),
        ("stack_exchange_paired", "chat (chosen)"),
        ("stack_exchange_paired", "chat (rejected)"),
    ]
    assert all(r["max_seq_len"] == 256 and r["skipped_rows"] == 0 for r in report)
    grammar = [
        [
            Message("user", f"Correct this to standard English: {r['input']}\n---\nCorrected: ", masked=True),
            Message("assistant", r["output"]),
        ]
        for r in _rows(small_files["grammar"])
    ]
    _assert_matches(report[0], _direct(tokenizer, grammar, 256))
    samsum = [
        [
            Message("user", f"Summarize this dialogue:\n{r['dialogue']}\n---\nSummary:\n", masked=True),
            Message("assistant", r["summary"]),
        ]
        for r in _rows(small_files["samsum"])
    ]
    expected = _direct(tokenizer, samsum, 256)
    _assert_matches(report[1], expected)
    assert 0 < report[1]["truncated_rows"] < 200  # the limit actually bites on samsum
    se = _rows(small_files["stack_exchange_paired"])
    for k, key in ((2, "response_j"), (3, "response_k")):
        convs = [[Message("user", r["question"], masked=True), Message("assistant", r[key])] for r in se]
        _assert_matches(report[k], _direct(tokenizer, convs, 256))


def test_report_subset_and_limit(small_files, tokenizer) -> None:
    from hlmtune.data_builders import token_count_report

    spec = {"samsum": {"source": "json", "data_files": str(small_files["samsum"])}}
    a = token_count_report(datasets=spec, tokenizer=tokenizer, subset_size=50, subset_seed=2, max_seq_len=10_000, progress=False)
    b = token_count_report(datasets=spec, tokenizer=tokenizer, subset_size=50, subset_seed=2, max_seq_len=10_000, progress=False)
    assert a == b and a[0]["rows"] == 50 and a[0]["truncated_rows"] == 0 and a[0]["max_seq_len"] == 10_000
    assert a[0]["prompt_tokens_total"] + a[0]["target_tokens_total"] == a[0]["tokens_total"]


def test_tokenizer_specs(tiny_tok, small_files) -> None:
    from hlmtune.data_builders import resolve_tokenizer, token_count_report

    by_path = resolve_tokenizer(tiny_tok["path"], special_tokens_path=tiny_tok["special_tokens_path"], max_seq_len=128)
    by_spec = resolve_tokenizer(
        {
            "_component_": "torchtune.models.llama3.llama3_tokenizer",
            "path": tiny_tok["path"],
            "special_tokens_path": tiny_tok["special_tokens_path"],
            "max_seq_len": 128,
        }
    )
    assert by_path.encode("Summarize this dialogue") == by_spec.encode("Summarize this dialogue")
    assert by_path.max_seq_len == by_spec.max_seq_len == 128
    with pytest.raises(FileNotFoundError):
        resolve_tokenizer(str(small_files["samsum"]) + ".missing")
    with pytest.raises(ValueError, match="did you mean 'samsum'"):
        token_count_report(datasets=["samsun"], tokenizer=by_path, progress=False)


def test_format_and_json(tmp_path: Path) -> None:
    from hlmtune.data_builders import COLUMNS, format_report, write_report_json
    from hlmtune.data_builders.report import nearest_rank, summarize_lengths

    assert nearest_rank([5, 1, 3, 2, 4, 6, 7, 8, 9, 10], 0.9) == 9
    assert nearest_rank([7], 0.9) == 7
    stats = summarize_lengths([10, 20, 30, 40], [4, 5, 6, 7], [6, 15, 24, 33], 25)
    assert stats["tokens_median"] == 25.0 and stats["tokens_p90"] == 40 and stats["truncated_rows"] == 2
    row = {"dataset": "samsum", "template": "summarize", "source": "s.jsonl", "skipped_rows": 0, **stats}
    md = format_report([row])
    lines = md.strip().splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |" and len(lines) == 3
    assert "| samsum | summarize | s.jsonl | 4 | 0 | 100 | 25.0 |" in lines[2]
    parsed = list(csv.DictReader(io.StringIO(format_report([row], "csv"))))
    assert parsed[0]["tokens_total"] == "100" and parsed[0]["truncated_rows"] == "2"
    out = tmp_path / "sub" / "report.json"
    write_report_json([row], out)
    data = json.loads(out.read_text())
    assert data["columns"] == list(COLUMNS) and data["rows"][0]["tokens_p90"] == 40
    assert [p.name for p in out.parent.iterdir()] == ["report.json"]  # no temp file left
    with pytest.raises(ValueError):
        format_report([row], "html")
