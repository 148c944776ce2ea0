"""Tests of data_builders/sft.py on the real samples ($HLM_DATA/text) and small corrupted copies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

ALPACA = "alpaca_cleaned.jsonl"
GRAMMAR = "grammar_c4_200m.jsonl"
SAMSUM = "samsum.jsonl"
SLIMORCA = "slimorca_sample.jsonl"


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    from hlmtune.tiny import write_tiny_tokenizer

    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tiny_tok: Dict[str, Any]):
    """Untruncated tiny Llama3 tokenizer: label checks compare whole targets."""
    from torchtune.models.llama3 import llama3_tokenizer

    return llama3_tokenizer(tiny_tok["path"], special_tokens_path=tiny_tok["special_tokens_path"], max_seq_len=None)


def _rows(path: Path) -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _target_ids(tokenizer, text: str) -> List[int]:
    """Assistant header + stripped text + <|eot_id|>: what the loss must see."""
    from torchtune.data import Message

    return tokenizer.tokenize_message(Message(role="assistant", content=text))


def _unmasked(sample: Dict[str, Any]) -> List[int]:
    return [int(x) for x in sample["labels"] if x != -100]


def _check_sft_sample(tokenizer, sample: Dict[str, Any], target: str) -> str:
    tokens, labels = sample["tokens"], sample["labels"]
    assert len(tokens) == len(labels)
    assert tokens[0] == tokenizer.bos_id and tokens[-1] == tokenizer.eos_id
    # Prompt masked, target (assistant turn) in the loss, final EOS masked (torchtune's mask).
    assert _unmasked(sample) == _target_ids(tokenizer, target)
    text = tokenizer.decode(_unmasked(sample), skip_special_tokens=True)
    assert text.endswith(target.strip())
    n_target = len(_unmasked(sample))
    # The unmasked labels are the contiguous block right before the final EOS.
    assert [int(x) for x in labels[-1 - n_target : -1]] == [int(x) for x in tokens[-1 - n_target : -1]]
    return tokenizer.decode([int(t) for t in tokens[: len(tokens) - n_target - 1]], skip_special_tokens=False)


def test_alpaca_real_sample(real_text_data_dir: Path, tokenizer) -> None:
    from hlmtune.data_builders import ValidatedSFTDataset, alpaca_cleaned_dataset

    rows = _rows(real_text_data_dir / ALPACA)
    ds = alpaca_cleaned_dataset(tokenizer, source="json", data_files=str(real_text_data_dir / ALPACA), train_on_input=False)
    assert isinstance(ds, ValidatedSFTDataset) and len(ds) == 2000 and ds.skipped_rows == 0
    for i in (0, 1, 7, 1999):
        row = rows[i]
        prompt = _check_sft_sample(tokenizer, ds[i], row["output"])
        assert "Below is an instruction that describes a task" in prompt
        assert f"### Instruction:\n{row['instruction']}" in prompt
        assert prompt.rstrip().endswith("### Response:<|eot_id|>")
        assert ("### Input:" in prompt) == bool(row["input"])
    # torchtune's default: the prompt is trained on.
    ds_in = alpaca_cleaned_dataset(tokenizer, source="json", data_files=str(real_text_data_dir / ALPACA), subset_size=3)
    s = ds_in[0]
    # Only BOS and the final EOS are masked (torchtune's Llama3 mask).
    assert [i for i, x in enumerate(s["labels"]) if x == -100] == [0, len(s["labels"]) - 1]


def test_grammar_real_sample(real_text_data_dir: Path, tokenizer) -> None:
    from hlmtune.data_builders import grammar_dataset

    rows = _rows(real_text_data_dir / GRAMMAR)
    ds = grammar_dataset(tokenizer, source="json", data_files=str(real_text_data_dir / GRAMMAR))
    assert len(ds) == 2000
    for i in (0, 500, 1999):
        prompt = _check_sft_sample(tokenizer, ds[i], rows[i]["output"])
        expected = f"Correct this to standard English: {rows[i]['input'].strip()}\n---\nCorrected:"
        assert expected in prompt, prompt


def test_samsum_real_sample(real_text_data_dir: Path, tokenizer) -> None:
    from hlmtune.data_builders import samsum_dataset

    rows = _rows(real_text_data_dir / SAMSUM)
    ds = samsum_dataset(tokenizer, source="json", data_files=str(real_text_data_dir / SAMSUM))
    assert len(ds) == 1637
    for i in (0, 800, 1636):
        prompt = _check_sft_sample(tokenizer, ds[i], rows[i]["summary"])
        assert f"Summarize this dialogue:\n{rows[i]['dialogue'].strip()}\n---\nSummary:" in prompt
        assert "\r\n" in prompt  # CRLF turn separators survive tokenization


def test_slimorca_real_sample(text_data_dir: Path, tokenizer) -> None:
    from hlmtune.data_builders import slimorca_dataset

    rows = _rows(text_data_dir / SLIMORCA)
    ds = slimorca_dataset(tokenizer, source="json", data_files=str(text_data_dir / SLIMORCA))
    assert len(ds) == 13
    for i in range(13):
        turns = rows[i]["conversations"]
        prompt = _check_sft_sample(tokenizer, ds[i], turns[-1]["value"])
        human = next(t["value"] for t in turns if t["from"] == "human")
        assert human.strip() in prompt
        if turns[0]["from"] == "system":
            assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")


def test_template_options(text_data_dir: Path, tokenizer, tiny_tok) -> None:
    from torchtune.models.llama3 import llama3_tokenizer

    from hlmtune.data_builders import grammar_dataset, samsum_dataset

    path = str(text_data_dir / SAMSUM)
    plain = samsum_dataset(tokenizer, source="json", data_files=path, subset_size=2, prompt_template=None)
    assert "Summarize this dialogue" not in tokenizer.decode(plain[0]["tokens"])
    custom = samsum_dataset(
        tokenizer, source="json", data_files=path, subset_size=2, prompt_template={"user": ["TL;DR of: ", "\nTL;DR:"]}
    )
    assert "TL;DR of: " in tokenizer.decode(custom[0]["tokens"], skip_special_tokens=False)
    grammar_tok = llama3_tokenizer(
        tiny_tok["path"], special_tokens_path=tiny_tok["special_tokens_path"],
        prompt_template="torchtune.data.GrammarErrorCorrectionTemplate",
    )
    with pytest.raises(ValueError, match="templated twice"):
        grammar_dataset(grammar_tok, source="json", data_files=str(text_data_dir / GRAMMAR))
    # The tokenizer's template alone is fine.
    ds = grammar_dataset(grammar_tok, source="json", data_files=str(text_data_dir / GRAMMAR), prompt_template=None, subset_size=1)
    assert "Correct this to standard English:" in grammar_tok.decode(ds[0]["tokens"])


def test_subset_is_deterministic(text_data_dir: Path, tokenizer) -> None:
    from hlmtune.data_builders import grammar_dataset

    kw = dict(source="json", data_files=str(text_data_dir / GRAMMAR), subset_size=500, subset_seed=7)
    a, b = grammar_dataset(tokenizer, **kw), grammar_dataset(tokenizer, **kw)
    assert len(a) == 500 and a.row_indices == b.row_indices
    assert [a[i]["tokens"] for i in (0, 250, 499)] == [b[i]["tokens"] for i in (0, 250, 499)]
    with pytest.raises(ValueError, match="subset_size=2001"):
        grammar_dataset(tokenizer, source="json", data_files=str(text_data_dir / GRAMMAR), subset_size=2001)


def test_bad_rows_error_and_skip(text_data_dir: Path, tmp_path: Path, tokenizer) -> None:
    from hlmtune.data_builders import BadRowError, alpaca_cleaned_dataset, samsum_dataset, slimorca_dataset

    rows = _rows(text_data_dir / SAMSUM)[:30]
    rows[17]["summary"] = ""
    rows[20]["dialogue"] = None
    path = tmp_path / "samsum.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(BadRowError, match=r"samsum: .*samsum\.jsonl row 17 \(0-based\), line 18: field 'summary' is empty"):
        samsum_dataset(tokenizer, source="json", data_files=str(path))
    ds = samsum_dataset(tokenizer, source="json", data_files=str(path), on_bad_row="skip")
    assert len(ds) == 28 and ds.skipped_rows == 2 and 17 not in ds.row_indices and 20 not in ds.row_indices

    arows = _rows(text_data_dir / ALPACA)[:10]
    arows[4]["instruction"] = ["a", "list"]
    apath = tmp_path / "alpaca.jsonl"
    apath.write_text("".join(json.dumps(r) + "\n" for r in arows), encoding="utf-8")
    with pytest.raises(BadRowError, match=r"alpaca\.jsonl row 4 \(0-based\), line 5: field 'instruction' has type list"):
        alpaca_cleaned_dataset(tokenizer, source="json", data_files=str(apath))

    srows = _rows(text_data_dir / SLIMORCA)
    srows[5]["conversations"][-1]["value"] = ""
    srows[8]["conversations"][1]["from"] = "bot"
    spath = tmp_path / "slim.jsonl"
    spath.write_text("".join(json.dumps(r) + "\n" for r in srows), encoding="utf-8")
    with pytest.raises(BadRowError, match=r"slim\.jsonl row 5 \(0-based\), line 6: field 'conversations': the last"):
        slimorca_dataset(tokenizer, source="json", data_files=str(spath))
    sds = slimorca_dataset(tokenizer, source="json", data_files=str(spath), on_bad_row="skip")
    assert len(sds) == 11 and sds.skipped_rows == 2


def test_parquet_source(text_data_dir: Path, tmp_path: Path, tokenizer) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hlmtune.data_builders import slimorca_dataset

    rows = _rows(text_data_dir / SLIMORCA)
    path = tmp_path / "slimorca.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    from_parquet = slimorca_dataset(tokenizer, source="parquet", data_files=str(path))
    from_json = slimorca_dataset(tokenizer, source="json", data_files=str(text_data_dir / SLIMORCA))
    assert len(from_parquet) == 13
    assert all(from_parquet[i]["tokens"] == from_json[i]["tokens"] for i in range(13))


def test_packed(text_data_dir: Path, tiny_tok) -> None:
    from torchtune.datasets import PackedDataset
    from torchtune.models.llama3 import llama3_tokenizer

    from hlmtune.data_builders import grammar_dataset

    tok = llama3_tokenizer(tiny_tok["path"], special_tokens_path=tiny_tok["special_tokens_path"], max_seq_len=512)
    ds = grammar_dataset(tok, source="json", data_files=str(text_data_dir / GRAMMAR), subset_size=40, packed=True)
    assert isinstance(ds, PackedDataset) and ds.skipped_rows == 0
    assert all(len(ds[i]["tokens"]) == 512 for i in range(len(ds)))


def test_collate_with_torchtune(text_data_dir: Path, tokenizer) -> None:
    from torchtune.data import padded_collate_sft

    from hlmtune.data_builders import samsum_dataset

    ds = samsum_dataset(tokenizer, source="json", data_files=str(text_data_dir / SAMSUM), subset_size=4)
    batch = padded_collate_sft([ds[i] for i in range(4)])
    assert batch["tokens"].shape == batch["labels"].shape and batch["tokens"].shape[0] == 4
    # DataLoader workers pickle the dataset.
    import pickle

    clone = pickle.loads(pickle.dumps(ds))
    assert clone[2] == ds[2] and clone.row_indices == ds.row_indices


def test_hub_is_default(monkeypatch: pytest.MonkeyPatch, text_data_dir: Path, tokenizer) -> None:
    import datasets

    from hlmtune.data_builders import alpaca_cleaned_dataset, grammar_dataset, samsum_dataset, slimorca_dataset

    calls = []
    files = {
        "yahma/alpaca-cleaned": ALPACA,
        "liweili/c4_200m": GRAMMAR,
        "Samsung/samsum": SAMSUM,
        "Open-Orca/SlimOrca-Dedup": SLIMORCA,
    }

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list(_rows(text_data_dir / files[path])[:5])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    for builder in (alpaca_cleaned_dataset, grammar_dataset, samsum_dataset, slimorca_dataset):
        assert len(builder(tokenizer)) == 5
    assert calls == [(name, {"data_files": None, "split": "train"}) for name in files]
    samsum_dataset(tokenizer, split="validation", revision="main")
    assert calls[-1] == ("Samsung/samsum", {"data_files": None, "split": "validation", "revision": "main"})


def test_typo_is_an_error(tokenizer) -> None:
    from hlmtune.data_builders import samsum_dataset

    with pytest.raises(TypeError, match="did you mean 'subset_size'"):
        samsum_dataset(tokenizer, subset_sise=5)


def test_instantiate_from_yaml(text_data_dir: Path, tokenizer) -> None:
    from omegaconf import OmegaConf
    from torchtune import config

    cfg = OmegaConf.create(
        {
            "_component_": "hlmtune.data_builders.samsum_dataset",
            "source": "json",
            "data_files": str(text_data_dir / SAMSUM),
            "subset_size": 500,
            "on_bad_row": "skip",
        }
    )
    ds = config.instantiate(cfg, tokenizer)
    assert len(ds) == 500 and ds.skipped_rows == 0
