"""Tests of data_builders/preference.py on the real samples and corrupted copies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

STACK = "stack_exchange_paired_tiny.jsonl"
HH = "hh_rlhf_harmless_base_test_messages.jsonl"
# Rows of the real HH sample whose chosen answer is empty (checked independently below).
HH_EMPTY_CHOSEN = [86, 516, 923, 1101]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from torchtune.models.llama3 import llama3_tokenizer

    from hlmtune.tiny import write_tiny_tokenizer

    tok = write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return llama3_tokenizer(tok["path"], special_tokens_path=tok["special_tokens_path"], max_seq_len=None)


def _rows(path: Path) -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _unmasked(labels) -> List[int]:
    return [int(x) for x in labels if x != -100]


def _assistant_ids(tokenizer, text: str) -> List[int]:
    from torchtune.data import Message

    return tokenizer.tokenize_message(Message(role="assistant", content=text))


def test_stack_exchange_real_sample(text_data_dir: Path, tokenizer) -> None:
    from torchtune.data import padded_collate_dpo
    from torchtune.datasets import PreferenceDataset

    from hlmtune.data_builders import stack_exchange_paired_dataset

    rows = _rows(text_data_dir / STACK)
    ds = stack_exchange_paired_dataset(tokenizer, source="json", data_files=str(text_data_dir / STACK))
    assert isinstance(ds, PreferenceDataset) and len(ds) == 25 and ds.skipped_rows == 0
    for i in (0, 12, 24):
        s = ds[i]
        assert set(s) == {"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"}
        for side, key in (("chosen", "response_j"), ("rejected", "response_k")):
            ids, labels = s[f"{side}_input_ids"], s[f"{side}_labels"]
            assert len(ids) == len(labels)
            # Only the answer is in the loss; the question is masked.
            assert _unmasked(labels) == _assistant_ids(tokenizer, rows[i][key])
            prompt = tokenizer.decode(ids[: len(ids) - len(_unmasked(labels)) - 1])
            assert rows[i]["question"].strip() in prompt
        # Same prompt on both sides.
        n_c = len(s["chosen_input_ids"]) - len(_unmasked(s["chosen_labels"]))
        n_r = len(s["rejected_input_ids"]) - len(_unmasked(s["rejected_labels"]))
        assert s["chosen_input_ids"][: n_c - 1] == s["rejected_input_ids"][: n_r - 1]
    ids, labels = padded_collate_dpo([ds[0], ds[1]])
    assert ids.shape == labels.shape and ids.shape[0] == 4


def test_hh_real_sample_bad_rows(real_text_data_dir: Path, tokenizer) -> None:
    from hlmtune.data_builders import BadRowError, hh_rlhf_dataset

    rows = _rows(real_text_data_dir / HH)
    assert [i for i, r in enumerate(rows) if not r["chosen"][-1]["content"].strip()] == HH_EMPTY_CHOSEN
    with pytest.raises(BadRowError, match=r"row 86 \(0-based\), line 87: field 'chosen': the last assistant turn \(the target\) is empty"):
        hh_rlhf_dataset(tokenizer, source="json", data_files=str(real_text_data_dir / HH))
    ds = hh_rlhf_dataset(tokenizer, source="json", data_files=str(real_text_data_dir / HH), on_bad_row="skip")
    assert len(ds) == 1996 and ds.skipped_rows == 4
    assert ds.row_indices == [i for i in range(2000) if i not in HH_EMPTY_CHOSEN]
    for k in (0, 85, 86, 1995):
        row = rows[ds.row_indices[k]]
        s = ds[k]
        for side in ("chosen", "rejected"):
            expected = []
            for turn in row[side]:
                if turn["role"] == "assistant":
                    expected += _assistant_ids(tokenizer, turn["content"])
            # Every assistant turn (multi-turn) is in the loss, every user turn masked.
            assert _unmasked(s[f"{side}_labels"]) == expected
            decoded = tokenizer.decode(s[f"{side}_input_ids"])
            assert row[side][0]["content"].strip() in decoded


def test_hh_transcript_strings(monkeypatch: pytest.MonkeyPatch, text_data_dir: Path, tmp_path: Path, tokenizer) -> None:
    """The hub's Anthropic/hh-rlhf stores transcripts; they give the same samples as lists."""
    import datasets

    from hlmtune.data_builders import hh_rlhf_dataset, parse_hh_transcript

    rows = _rows(text_data_dir / HH)[:8]

    def to_text(turns):
        return "".join(f"\n\n{'Human' if t['role'] == 'user' else 'Assistant'}: {t['content']}" for t in turns)

    hub_rows = [{"chosen": to_text(r["chosen"]), "rejected": to_text(r["rejected"])} for r in rows]
    assert parse_hh_transcript(hub_rows[0]["chosen"]) == [
        {"role": t["role"], "content": t["content"].strip()} for t in rows[0]["chosen"]
    ]
    assert parse_hh_transcript("no markers") is None
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list(hub_rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    from_hub = hh_rlhf_dataset(tokenizer, data_dir="harmless-base", split="test")
    assert calls == [("Anthropic/hh-rlhf", {"data_files": None, "split": "test", "data_dir": "harmless-base"})]
    monkeypatch.undo()
    path = tmp_path / "hh8.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    local = hh_rlhf_dataset(tokenizer, source="json", data_files=str(path))
    assert len(local) == len(from_hub) == 8
    for i in range(8):
        assert from_hub[i] == local[i]


def test_bad_rows_named(text_data_dir: Path, tmp_path: Path, tokenizer) -> None:
    from hlmtune.data_builders import BadRowError, hh_rlhf_dataset, stack_exchange_paired_dataset

    rows = _rows(text_data_dir / STACK)[:10]
    rows[6]["response_k"] = ""
    rows[8].pop("question")
    path = tmp_path / "se.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(BadRowError, match=r"se\.jsonl row 6 \(0-based\), line 7: field 'response_k' is empty"):
        stack_exchange_paired_dataset(tokenizer, source="json", data_files=str(path))
    ds = stack_exchange_paired_dataset(tokenizer, source="json", data_files=str(path), on_bad_row="skip")
    assert len(ds) == 8 and ds.skipped_rows == 2

    hrows = _rows(text_data_dir / HH)[:6]
    hrows[3]["rejected"] = hrows[3]["rejected"][:-1]  # ends on a user turn: no target
    hpath = tmp_path / "hh.jsonl"
    hpath.write_text("".join(json.dumps(r) + "\n" for r in hrows), encoding="utf-8")
    with pytest.raises(BadRowError, match=r"hh\.jsonl row 3 \(0-based\), line 4: field 'rejected': last turn is 'user'"):
        hh_rlhf_dataset(tokenizer, source="json", data_files=str(hpath))


def test_subset_and_packed(text_data_dir: Path, tokenizer) -> None:
    from hlmtune.data_builders import stack_exchange_paired_dataset

    kw = dict(source="json", data_files=str(text_data_dir / STACK), subset_size=10, subset_seed=1)
    a = stack_exchange_paired_dataset(tokenizer, **kw)
    b = stack_exchange_paired_dataset(tokenizer, **kw)
    assert len(a) == 10 and a.row_indices == b.row_indices and a[3] == b[3]
    with pytest.raises(ValueError, match="subset_size=26"):
        stack_exchange_paired_dataset(tokenizer, source="json", data_files=str(text_data_dir / STACK), subset_size=26)
    with pytest.raises(ValueError, match="packed"):
        stack_exchange_paired_dataset(tokenizer, source="json", data_files=str(text_data_dir / STACK), packed=True)


def test_stack_exchange_hub_default(monkeypatch: pytest.MonkeyPatch, text_data_dir: Path, tokenizer) -> None:
    import datasets

    from hlmtune.data_builders import stack_exchange_paired_dataset

    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list(_rows(text_data_dir / STACK)[:3])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert len(stack_exchange_paired_dataset(tokenizer)) == 3
    assert calls == [("lvwerra/stack-exchange-paired", {"data_files": None, "split": "train", "data_dir": "data/rl"})]
