"""Inter-patient splits: DS2 only for evaluation, overlap refused, random split deterministic."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hlmtune.ecg_tokenizer.labels import MITDB_DS1, MITDB_DS2
from hlmtune.ecg_tokenizer import splits as sp

ALL = list(MITDB_DS1) + list(MITDB_DS2) + ["102", "104"]


def test_published_split_is_disjoint_and_complete():
    assert len(MITDB_DS1) == len(MITDB_DS2) == 22 and not set(MITDB_DS1) & set(MITDB_DS2)
    assert not {"102", "104", "107", "217"} & (set(MITDB_DS1) | set(MITDB_DS2))  # paced records excluded


def test_training_defaults_to_ds1_and_refuses_ds2():
    assert sp.resolve_records(split="DS1", records=None, split_file=None, available=ALL) == list(MITDB_DS1)
    with pytest.raises(sp.SplitError, match=r"\['100'\] are test records \(DS2\)"):
        sp.resolve_records(split="DS1", records=["101", "100"], split_file=None, available=ALL)
    with pytest.raises(sp.SplitError, match="test records"):
        sp.resolve_records(split="DS2", records=None, split_file=None, available=ALL)
    assert sp.resolve_records(split="DS2", records=None, split_file=None, available=ALL, evaluation=True) == list(MITDB_DS2)
    with pytest.raises(sp.SplitError, match="did you mean 'DS1'"):
        sp.resolve_records(split="DS11", records=None, split_file=None, available=ALL)


def test_missing_records_and_split_files(tmp_path):
    with pytest.raises(sp.SplitError, match="not in the token shards.*split_file"):
        sp.resolve_records(split="DS1", records=None, split_file=None, available=["s000"])
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"DS1": ["a", "b"], "DS2": ["c"]}))
    assert sp.resolve_records(split="DS1", records=None, split_file=str(f), available=["c", "b", "a"]) == ["b", "a"]
    f.write_text(json.dumps({"DS1": ["a", "c"], "DS2": ["c"]}))
    with pytest.raises(sp.SplitError, match=r"in both DS1 and DS2: \['c'\]"):
        sp.load_split_file(str(f))
    # JSON numbers name the same records as strings (the shards' names): 100 == "100"
    f.write_text(json.dumps({"DS1": [100, 101], "DS2": ["100"]}))
    with pytest.raises(sp.SplitError, match=r"in both DS1 and DS2: \['100'\]"):
        sp.load_split_file(str(f))
    f.write_text("{")
    with pytest.raises(sp.SplitError, match="not JSON"):
        sp.load_split_file(str(f))


def test_overlap_is_refused():
    sp.check_disjoint(["101", "106"], ["100"])
    with pytest.raises(sp.SplitError, match=r"meet its test records: \['106'\]"):
        sp.check_disjoint(["101", "106"], ["100", "106"])


def test_random_beat_split_is_seeded_and_sized():
    a = sp.random_beat_mask("100", 10000, seed=3, test_fraction=0.2)
    assert np.array_equal(a, sp.random_beat_mask("100", 10000, seed=3, test_fraction=0.2))
    assert not np.array_equal(a, sp.random_beat_mask("101", 10000, seed=3, test_fraction=0.2))
    assert 0.18 < a.mean() < 0.22
    assert "NOT comparable" in sp.RANDOM_SPLIT_NOTICE


QUALIFIED = [f"mitdb/{r}" for r in (*MITDB_DS1, *MITDB_DS2)] + ["svdb/800", "svdb/802"]


def test_qualified_ids_resolve_from_mitbih_names_and_extra_records_add_patients():
    got = sp.resolve_records(split="DS1", records=None, split_file=None, available=QUALIFIED, extra_records="svdb")
    assert got == [f"mitdb/{r}" for r in MITDB_DS1] + ["svdb/800", "svdb/802"]
    assert sp.resolve_records(split="DS1", records=None, split_file=None, available=QUALIFIED,
                              extra_records=["svdb/802"])[-1] == "svdb/802"
    for none in (None, "", []):
        assert sp.extra_records_of(none, QUALIFIED) == []
    with pytest.raises(sp.SplitError, match=r"hold no record of database 'incartdb' \(databases: mitdb, svdb\)"):
        sp.extra_records_of("incartdb", QUALIFIED)
    with pytest.raises(sp.SplitError, match="are test records"):  # a DS2 patient is never an extra one
        sp.extra_records_of(["100"], QUALIFIED)
    with pytest.raises(sp.SplitError, match="not in the token shards"):
        sp.extra_records_of(["svdb/899"], QUALIFIED)
    with pytest.raises(sp.SplitError, match="test records"):  # DS2 by its MIT-BIH name, in qualified shards
        sp.resolve_records(split="DS1", records=["100"], split_file=None, available=QUALIFIED)


def test_an_overlap_across_databases_is_refused_by_id_and_by_signal():
    sp.check_disjoint(["svdb/800"], ["mitdb/100"], digests={"svdb/800": "a", "mitdb/100": "b"})
    with pytest.raises(sp.SplitError, match="meet its test records"):
        sp.check_disjoint(["mitdb/100", "svdb/800"], ["mitdb/100"])
    # the same recording tokenized under two databases' names: one patient, refused
    with pytest.raises(sp.SplitError, match=r"same signal as test records \(copy/100 = mitdb/100\)"):
        sp.check_disjoint(["copy/100"], ["mitdb/100"], digests={"copy/100": "x", "mitdb/100": "x"})


def test_the_test_records_a_run_trained_on_are_found_by_id_and_by_signal():
    """What --skip-trained-records leaves out: exactly the records check_disjoint refuses, in test order."""
    digests = {"svdb/800": "a", "other/900": "a", "other/901": "b", "svdb/802": "c"}
    train = ["svdb/800", "svdb/802"]
    test = ["other/901", "svdb/802", "other/900"]
    assert sp.shared_with_training(train, test, digests=digests) == ["svdb/802", "other/900"]
    assert sp.shared_with_training(train, test) == ["svdb/802"]  # without digests: by id only
    left = [r for r in test if r not in sp.shared_with_training(train, test, digests=digests)]
    sp.check_disjoint(train, left, digests=digests)  # what remains is disjoint
    assert sp.shared_with_training(train, ["other/901"], digests={"other/901": None, "svdb/800": None}) == []
