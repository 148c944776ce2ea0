"""Training dataset over memory-mapped shards, as torchtune recipes instantiate it."""

from __future__ import annotations

import numpy as np
import pytest

from hlmtune.ecg_tokenizer.dataset import ECGTokensDataset, ecg_tokens_dataset
from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
from hlmtune.ecg_tokenizer.synth import write_synthetic_database
from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer
from hlmtune.ecg_tokenizer.vocab import TokenizerParams


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    write_synthetic_database(root / "db", n_records=2, duration_s=40)
    tokenize_directory(root / "db", root / "out", params=TokenizerParams(), options=RecordOptions(), progress=False)
    return root / "out"


def test_windows_labels_and_alignment(shards):
    tk = ECGTokenizer(manifest_path=str(shards), max_seq_len=400)
    ds = ecg_tokens_dataset(tk, stride=200)
    assert isinstance(ds, ECGTokensDataset) and len(ds) > 4
    whole = {r: np.load(shards / "records" / f"{r}.tokens.npy") for r in ("s000", "s001")}
    seen = set()
    for i in range(len(ds)):
        s = ds[i]
        assert s["labels"] == s["tokens"] and 2 <= len(s["tokens"]) <= 400
        assert s["tokens"][0] in (tk.bos_id, tk.sep_id)  # starts at the record or a beat
        rec = "s000" if int(ds._rec[i]) == 0 else "s001"
        st = int(ds._start[i])
        assert s["tokens"] == whole[rec][st : st + 400].tolist()
        seen.update(range(st, st + len(s["tokens"])) if rec == "s000" else [])
    assert seen == set(range(whole["s000"].size))  # windows cover every token


def test_collate_and_instantiate(shards):
    from omegaconf import OmegaConf
    from torchtune import config
    from torchtune.data import padded_collate_sft

    tk = ECGTokenizer(manifest_path=str(shards), max_seq_len=256)
    cfg = OmegaConf.create({"_component_": "hlmtune.ecg_tokenizer.dataset.ecg_tokens_dataset", "stride": 300,
                            "records": ["s001"]})
    ds = config.instantiate(cfg, tk)  # the recipe passes the tokenizer positionally
    batch = padded_collate_sft([ds[0], ds[len(ds) - 1]], padding_idx=tk.pad_id, ignore_idx=-100)
    assert batch["tokens"].shape == batch["labels"].shape and batch["tokens"].shape[0] == 2
    assert batch["tokens"].max() < tk.vocab_size


def test_memmap_not_copied_and_errors(shards):
    ds = ECGTokensDataset(shards, max_seq_len=128, align_to_beats=False)
    ds[0]
    m = next(iter(ds._maps.values()))
    assert isinstance(m, np.memmap) or isinstance(getattr(m, "base", None), np.memmap)
    with pytest.raises(ValueError, match="tokenizer parameters disagree"):
        ecg_tokens_dataset(ECGTokenizer(levels=64, max_seq_len=128), shards_dir=str(shards))
    with pytest.raises(ValueError, match=r"records not in .*: \['nope'\]"):
        ECGTokensDataset(shards, max_seq_len=128, records=["nope"])
    with pytest.raises(ValueError, match="split must be one of"):
        ecg_tokens_dataset(ECGTokenizer(max_seq_len=128), shards_dir=str(shards), split="DS3")
    with pytest.raises(FileNotFoundError, match="no ECG token manifest"):
        ECGTokensDataset(shards / "records", max_seq_len=128)
    import pickle

    clone = pickle.loads(pickle.dumps(ds))  # DataLoader workers
    assert clone._maps == {} and clone[1] == ds[1]


def test_training_windows_never_come_from_test_records(shards, tmp_path):
    """The shards of an inter-patient database hold its test records too: by default the windows
    come from its train records only, and test records are refused however they are asked for."""
    import json

    tk = ECGTokenizer(manifest_path=str(shards), max_seq_len=128)
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"DS1": ["s000"], "DS2": ["s001"]}))

    def records_of(ds):
        return {ds.records[int(i)]["record"] for i in ds._rec}

    assert records_of(ecg_tokens_dataset(tk)) == {"s000", "s001"}  # no split of these names: all
    assert records_of(ecg_tokens_dataset(tk, split_file=str(split))) == {"s000"}
    assert records_of(ecg_tokens_dataset(tk, split="random", split_file=str(split))) == {"s000", "s001"}
    for ask in ({"split": "DS2"}, {"records": ["s001"]}):
        with pytest.raises(ValueError, match=r"\['s001'\] are test records"):
            ecg_tokens_dataset(tk, split_file=str(split), **ask)
    # MIT-BIH names (every DS1 record and DS2's 100, copies of the two synthetic records): the
    # DS2 record in the shards makes DS1 the default
    import copy

    from hlmtune.ecg_tokenizer.labels import MITDB_DS1

    mit = tmp_path / "mit"
    manifest = json.loads((shards / "manifest.json").read_text())
    first, second = manifest["records"]
    records = []
    for name, rec in [(r, first) for r in MITDB_DS1] + [("100", second)]:
        rec = copy.deepcopy(rec)
        for out in rec["outputs"].values():
            dst = mit / out["file"].replace(rec["record"], name)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes((shards / out["file"]).read_bytes())
            out["file"] = out["file"].replace(rec["record"], name)
        rec["record"] = name
        records.append(rec)
    (mit / "manifest.json").write_text(json.dumps({**manifest, "records": records}))
    assert records_of(ecg_tokens_dataset(tk, shards_dir=str(mit))) == set(MITDB_DS1)
    with pytest.raises(ValueError, match=r"\['100'\] are test records"):
        ecg_tokens_dataset(tk, shards_dir=str(mit), records=["101", "100"])
