"""Label tables against the MIT-BIH README facts (AAMI counts of the whole database)."""

from __future__ import annotations

from collections import Counter

import pytest

from hlmtune.ecg_tokenizer.labels import (
    AAMI_MAP,
    BEAT_SYMBOLS,
    MITDB_DS1,
    MITDB_DS2,
    NON_BEAT_SYMBOLS,
    UNLABELED,
    label_classes,
    rhythm_name,
    symbol_to_class,
)


@pytest.fixture(scope="module")
def mitdb_symbols(real_mitdb_dir):
    import wfdb

    names = (real_mitdb_dir / "RECORDS").read_text().split()
    return {n: wfdb.rdann(str(real_mitdb_dir / n), "atr").symbol for n in names}


def test_tables_are_consistent():
    assert set(AAMI_MAP) == set(BEAT_SYMBOLS)
    assert not set(BEAT_SYMBOLS) & set(NON_BEAT_SYMBOLS)
    assert label_classes("aami") == ["N", "S", "V", "F", "Q", UNLABELED]
    assert label_classes("raw")[:-1] == list(BEAT_SYMBOLS)
    raw = symbol_to_class("raw")
    assert [raw[s] for s in BEAT_SYMBOLS] == list(range(len(BEAT_SYMBOLS)))
    with pytest.raises(ValueError, match="label_mode"):
        label_classes("aaml")
    assert rhythm_name("(AFIB\x00") == "(AFIB" and rhythm_name("") == "" and rhythm_name("xyz") == ""


def test_aami_counts_match_readme(mitdb_symbols):
    """README: 109,494 beats; N 90,631, S 2,781, V 7,236, F 803, Q 8,043; DS1/DS2 counts."""
    assert len(mitdb_symbols) == 48
    classes = label_classes("aami")
    s2c = symbol_to_class("aami")

    def count(names):
        c = Counter()
        for n in names:
            for s in mitdb_symbols[n]:
                if s in s2c:
                    c[classes[s2c[s]]] += 1
                else:
                    assert s in NON_BEAT_SYMBOLS, (n, s)
        return c

    total = count(mitdb_symbols)
    assert sum(total.values()) == 109_494
    assert total == Counter({"N": 90_631, "S": 2_781, "V": 7_236, "F": 803, "Q": 8_043})
    assert count(MITDB_DS1) == Counter({"N": 45_866, "S": 944, "V": 3_788, "F": 415, "Q": 8})
    assert count(MITDB_DS2) == Counter({"N": 44_259, "S": 1_837, "V": 3_221, "F": 388, "Q": 7})
