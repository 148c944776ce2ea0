"""Tests of data_builders/loading.py: row checks, bad-row policy, subsets, sources."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from hlmtune.data_builders.loading import (
    BadRowError,
    check_message_list,
    check_text_field,
    prepare_rows,
    reject_typos,
)

SAMPLES = [
    "alpaca_cleaned.jsonl",
    "grammar_c4_200m.jsonl",
    "samsum.jsonl",
    "slimorca_sample.jsonl",
    "hh_rlhf_harmless_base_test_messages.jsonl",
    "stack_exchange_paired_tiny.jsonl",
]


def _samsum_check(row):
    return check_text_field(row, "dialogue") or check_text_field(row, "summary")


def _read_rows(path: Path, n: int) -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def _write_jsonl(path: Path, rows: List[Any]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def test_real_samples_match_sha256sums(real_text_data_dir: Path) -> None:
    sums = {}
    for line in (real_text_data_dir / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name] = digest
    for name in SAMPLES:
        assert hashlib.sha256((real_text_data_dir / name).read_bytes()).hexdigest() == sums[name], name


def test_check_text_field() -> None:
    assert check_text_field({"a": "x"}, "a") is None
    assert check_text_field({"a": ""}, "a") == "field 'a' is empty"
    assert check_text_field({"a": "  \r\n"}, "a") == "field 'a' is empty"
    assert check_text_field({"a": 3}, "a") == "field 'a' has type int, expected str"
    assert "is missing" in check_text_field({"b": "x"}, "a")
    assert "is missing (null)" in check_text_field({"a": None}, "a")
    assert check_text_field({"a": None}, "a", allow_empty=True) is None
    assert check_text_field({"a": ""}, "a", allow_empty=True) is None
    assert check_text_field({"a": 1}, "a", allow_empty=True) == "field 'a' has type int, expected str"


def test_check_message_list() -> None:
    roles = {"system": "system", "user": "user", "assistant": "assistant"}

    def check(msgs):
        return check_message_list(msgs, "chosen", role_key="role", content_key="content", role_map=roles)

    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert check(good) is None
    assert check([{"role": "system", "content": "s"}] + good) is None
    assert "at least" in check(good[:1])
    assert "the last assistant turn (the target) is empty" in check([good[0], {"role": "assistant", "content": " "}])
    assert "expected the assistant's" in check(good + [{"role": "user", "content": "more"}])
    assert "two user turns" in check([good[0], good[0], good[1]])
    assert "turn 1: 'role' is 'bot'" in check([good[0], {"role": "bot", "content": "a"}])
    assert "turn 0: 'content' has type int" in check([{"role": "user", "content": 1}, good[1]])
    assert "expected a list" in check("text")
    assert "system message after" in check(good + [{"role": "system", "content": "s"}] + good)


def test_bad_row_error_names_file_and_row(text_data_dir: Path, tmp_path: Path) -> None:
    rows = _read_rows(text_data_dir / "samsum.jsonl", 20)
    rows[17]["summary"] = ""
    path = _write_jsonl(tmp_path / "samsum.jsonl", rows)
    with pytest.raises(BadRowError) as e:
        prepare_rows(name="samsum", source="json", data_files=str(path), split="train", check=_samsum_check)
    msg = str(e.value)
    assert f"{path} row 17 (0-based), line 18: field 'summary' is empty" in msg
    assert "on_bad_row='skip'" in msg


def test_missing_field_and_blank_lines(text_data_dir: Path, tmp_path: Path) -> None:
    rows = _read_rows(text_data_dir / "samsum.jsonl", 6)
    del rows[4]["dialogue"]
    lines = [json.dumps(r) for r in rows]
    lines.insert(2, "")  # a blank line: row 4 is on line 6
    path = _write_jsonl(tmp_path / "s.jsonl", lines)
    with pytest.raises(BadRowError, match=r"s\.jsonl row 4 \(0-based\), line 6: field 'dialogue' is missing"):
        prepare_rows(name="samsum", source="json", data_files=str(path), split="train", check=_samsum_check)


def test_wrong_type_and_invalid_json_are_found_by_line(text_data_dir: Path, tmp_path: Path) -> None:
    # pyarrow rejects these files as a whole; the line reader must still name the row.
    rows = _read_rows(text_data_dir / "samsum.jsonl", 10)
    rows[3]["summary"] = 42
    path = _write_jsonl(tmp_path / "typed.jsonl", rows)
    with pytest.raises(BadRowError, match=r"typed\.jsonl row 3 \(0-based\), line 4: field 'summary' has type int"):
        prepare_rows(name="samsum", source="json", data_files=str(path), split="train", check=_samsum_check)

    lines = [json.dumps(r) for r in _read_rows(text_data_dir / "samsum.jsonl", 10)]
    lines[7] = lines[7][:-5]  # truncated JSON object
    path = _write_jsonl(tmp_path / "broken.jsonl", lines)
    with pytest.raises(BadRowError, match=r"broken\.jsonl row 7 \(0-based\), line 8: not valid JSON"):
        prepare_rows(name="samsum", source="json", data_files=str(path), split="train", check=_samsum_check)
    out = prepare_rows(
        name="samsum", source="json", data_files=str(path), split="train", check=_samsum_check, on_bad_row="skip"
    )
    assert out.skipped_rows == 1 and len(out.data) == 9
    assert out.data["id"] == [r["id"] for i, r in enumerate(_read_rows(text_data_dir / "samsum.jsonl", 10)) if i != 7]


def test_skip_and_count(text_data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = _read_rows(text_data_dir / "samsum.jsonl", 30)
    bad = {2, 11, 29}
    for i in bad:
        rows[i]["summary"] = ""
    path = _write_jsonl(tmp_path / "samsum.jsonl", rows)
    with caplog.at_level("WARNING"):
        out = prepare_rows(
            name="samsum", source="json", data_files=str(path), split="train", check=_samsum_check, on_bad_row="skip"
        )
    assert out.skipped_rows == 3
    assert out.row_indices == [i for i in range(30) if i not in bad]
    assert out.data["id"] == [rows[i]["id"] for i in out.row_indices]
    assert "skipped 3 bad row(s)" in caplog.text and "row 11 (0-based), line 12" in caplog.text


def test_subset_deterministic_size_and_errors(real_text_data_dir: Path) -> None:
    path = str(real_text_data_dir / "samsum.jsonl")
    kw = dict(name="samsum", source="json", data_files=path, split="train", check=_samsum_check)
    a = prepare_rows(subset_size=50, subset_seed=3, **kw)
    b = prepare_rows(subset_size=50, subset_seed=3, **kw)
    c = prepare_rows(subset_size=50, subset_seed=4, **kw)
    assert len(a.data) == 50 and a.row_indices == b.row_indices == sorted(set(a.row_indices))
    assert a.data["id"] == b.data["id"]
    assert a.row_indices != c.row_indices
    # The subset is the first 50 of the seeded permutation (a uniform sample, not a prefix).
    import numpy as np

    assert a.row_indices == sorted(np.random.default_rng(3).permutation(1637)[:50].tolist())
    full = prepare_rows(subset_size=1637, **kw)
    assert len(full.data) == 1637
    with pytest.raises(ValueError, match="subset_size=1638 but .* has only 1637 usable rows"):
        prepare_rows(subset_size=1638, **kw)
    with pytest.raises(ValueError, match="positive int"):
        prepare_rows(subset_size=0, **kw)
    with pytest.raises(ValueError, match="on_bad_row"):
        prepare_rows(on_bad_row="ignore", **kw)


def test_subset_skips_bad_rows_and_applies_filter(text_data_dir: Path, tmp_path: Path) -> None:
    rows = _read_rows(text_data_dir / "samsum.jsonl", 40)
    for i in range(0, 40, 4):
        rows[i]["summary"] = ""
    path = _write_jsonl(tmp_path / "samsum.jsonl", rows)
    out = prepare_rows(
        name="samsum", source="json", data_files=str(path), split="train", check=_samsum_check,
        on_bad_row="skip", subset_size=10, subset_seed=0, filter_fn=lambda r: len(r["dialogue"]) > 0,
    )
    assert len(out.data) == 10 and all(i % 4 for i in out.row_indices)
    with pytest.raises(ValueError, match="10 removed by filter_fn"):
        prepare_rows(
            name="samsum", source="json", data_files=str(path), split="train", check=_samsum_check,
            on_bad_row="skip", subset_size=21, filter_fn=lambda r: r["id"] not in {x["id"] for x in rows[1:40:4]},
        )


def test_parquet_source(text_data_dir: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _read_rows(text_data_dir / "samsum.jsonl", 25)
    rows[9]["summary"] = ""
    path = tmp_path / "samsum.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(BadRowError, match=r"samsum\.parquet row 9 \(0-based\): field 'summary' is empty"):
        prepare_rows(name="samsum", source="parquet", data_files=str(path), split="train", check=_samsum_check)
    out = prepare_rows(
        name="samsum", source="parquet", data_files=str(path), split="train", check=_samsum_check, on_bad_row="skip"
    )
    assert out.skipped_rows == 1 and out.data["dialogue"] == [r["dialogue"] for i, r in enumerate(rows) if i != 9]
    # A file path as source picks the loader from the extension.
    out2 = prepare_rows(name="samsum", source=str(path), data_files=None, split="train", check=_samsum_check, on_bad_row="skip")
    assert out2.row_indices == out.row_indices


def test_multiple_files_keep_their_names(text_data_dir: Path, tmp_path: Path) -> None:
    rows = _read_rows(text_data_dir / "samsum.jsonl", 12)
    first = _write_jsonl(tmp_path / "part1.jsonl", rows[:5])
    rows[9]["dialogue"] = ["not", "text"]
    second = _write_jsonl(tmp_path / "part2.jsonl", rows[5:])
    with pytest.raises(BadRowError, match=r"part2\.jsonl row 4 \(0-based\), line 5: field 'dialogue' has type list"):
        prepare_rows(name="samsum", source="json", data_files=[str(first), str(second)], split="train", check=_samsum_check)
    out = prepare_rows(
        name="samsum", source="json", data_files=str(tmp_path / "part*.jsonl"), split="train",
        check=_samsum_check, on_bad_row="skip",
    )
    assert out.skipped_rows == 1 and out.data["id"] == [r["id"] for i, r in enumerate(rows) if i != 9]


def test_local_source_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pass data_files"):
        prepare_rows(name="samsum", source="json", data_files=None, split="train", check=_samsum_check)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        prepare_rows(name="samsum", source="json", data_files=str(tmp_path / "nope.jsonl"), split="train", check=_samsum_check)


def test_hub_source_row_names(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list([{"dialogue": "a: hi", "summary": "s"}, {"dialogue": "b: yo", "summary": ""}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(BadRowError, match=r"Samsung/samsum \(split 'test'\) row 1 \(0-based\): field 'summary' is empty"):
        prepare_rows(name="samsum", source="Samsung/samsum", data_files=None, split="test", check=_samsum_check)
    assert calls == [("Samsung/samsum", {"data_files": None, "split": "test"})]


def test_reject_typos() -> None:
    reject_typos("samsum", {"data_dir": "x", "name": "cfg", "revision": "main"}, ["subset_size"])
    with pytest.raises(TypeError, match="unknown argument 'subset_sise'; did you mean 'subset_size'"):
        reject_typos("samsum", {"subset_sise": 5}, ["subset_size", "subset_seed"])
    with pytest.raises(ValueError, match="streaming"):
        reject_typos("samsum", {"streaming": True}, [])


def test_hub_failure_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(path, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"could not load hub dataset 'Samsung/samsum' .*ConnectionError.*source='json'") as e:
        prepare_rows(name="samsum", source="Samsung/samsum", data_files=None, split="train", check=_samsum_check)
    assert isinstance(e.value.__cause__, ConnectionError)


def test_lazy_visit_order_for_huge_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    import itertools

    from hlmtune.data_builders import loading

    monkeypatch.setattr(loading, "_PERMUTATION_LIMIT", 100)
    order = list(loading._visit_order(1000, 10, seed=5))
    assert sorted(order) == list(range(1000))  # every row, once
    assert order == list(loading._visit_order(1000, 10, seed=5))
    assert order[:50] != list(loading._visit_order(1000, 10, seed=6))[:50]
    assert list(itertools.islice(loading._visit_order(50, 10, seed=5), 50)) == [
        int(i) for i in __import__("numpy").random.default_rng(5).permutation(50)
    ]
    assert list(loading._visit_order(5, None, seed=1)) == [0, 1, 2, 3, 4]
