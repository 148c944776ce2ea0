"""The vectorised MIT annotation reader equals ``wfdb.rdann`` (the reference) field by field,
or declines (None) so that ``load_record`` falls back to ``wfdb.rdann``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import wfdb

from hlmtune.ecg_tokenizer import records as records_mod
from hlmtune.ecg_tokenizer.annotations import parse_mit_annotations, read_mit_annotations
from hlmtune.ecg_tokenizer.records import RecordError, list_records, load_record

INT_FIELDS = ("subtype", "chan", "num")


def assert_same_as_wfdb(fast, ref) -> None:
    """Every field the tokenizer can take from rdann, with wfdb's dtypes."""
    assert fast is not None
    assert fast.sample.dtype == ref.sample.dtype == np.int64
    assert np.array_equal(fast.sample, ref.sample)
    assert fast.symbol == ref.symbol
    assert fast.aux_note == ref.aux_note
    for f in INT_FIELDS:
        a, b = getattr(fast, f), getattr(ref, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f


def words_of(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype="<u2")


@pytest.mark.parametrize("sampto", [None, 360 * 60, 650_000])
def test_every_mitdb_record_equals_rdann(real_mitdb_dir, sampto):
    names = list_records(real_mitdb_dir)
    assert len(names) == 48
    for name in names:
        ref = wfdb.rdann(str(real_mitdb_dir / name), "atr", sampto=sampto)
        fast = read_mit_annotations(real_mitdb_dir / f"{name}.atr", sampto=sampto)
        assert_same_as_wfdb(fast, ref)


def test_mitdb_uses_subtype_skip_and_aux(real_mitdb_dir):
    """The real files exercise SUB, SKIP and AUX words (so the test above covers them)."""
    codes = np.concatenate([words_of(p) >> 10 for p in sorted(real_mitdb_dir.glob("*.atr"))])
    for code in (59, 61, 63):
        assert np.count_nonzero(codes == code) > 0, code


def test_sampto_keeps_the_annotation_at_sampto(mitdb_dir):
    ref_all = wfdb.rdann(str(mitdb_dir / "100"), "atr")
    t = int(ref_all.sample[10])
    for sampto in (t - 1, t, t + 1):
        ref = wfdb.rdann(str(mitdb_dir / "100"), "atr", sampto=sampto)
        fast = read_mit_annotations(mitdb_dir / "100.atr", sampto=sampto)
        assert_same_as_wfdb(fast, ref)
    assert read_mit_annotations(mitdb_dir / "100.atr", sampto=t).sample[-1] == t  # inclusive, like wfdb


def _write(tmp_path: Path, name: str, sample, symbol, **fields) -> Path:
    wfdb.wrann(name, "atr", np.asarray(sample, dtype=np.int64), symbol=symbol, write_dir=str(tmp_path), **fields)
    return tmp_path / f"{name}.atr"


def _check_file(path: Path, sampto=None):
    ref = wfdb.rdann(str(path.with_suffix("")), path.suffix[1:], sampto=sampto)
    fast = read_mit_annotations(path, sampto=sampto)
    assert_same_as_wfdb(fast, ref)
    return fast


def test_skip_intervals(tmp_path):
    # gaps of 1023 (fits in I), 1024 (SKIP), > 2**16 (SKIP high word) and > 2**24
    sample = np.cumsum([5, 1023, 1024, 70_000, 1, 20_000_000, 3])
    path = _write(tmp_path, "skip", sample, ["N"] * sample.size)
    assert np.count_nonzero(words_of(path) >> 10 == 59) == 3  # wrann emitted SKIPs
    fast = _check_file(path)
    assert fast.sample.tolist() == sample.tolist()
    for sampto in (sample[2] - 1, sample[3], sample[5] + 1):
        _check_file(path, sampto=int(sampto))


def test_aux_odd_even_lengths_and_payload_that_looks_like_headers(tmp_path):
    # "xü": the payload word 0xFC78 has code 63 (AUX) and "ab" code 24: both are payload.
    notes = ["(N", "(AFIB", "", "x\u00fc", "ab", "a", "\u00ec\u00ec\u00ec", "(VT\x00", ""]
    sample = np.arange(1, len(notes) + 1) * 100
    symbol = ["+", "+", "N", '"', '"', "+", '"', "+", "V"]
    path = _write(tmp_path, "aux", sample, symbol, aux_note=notes)
    fast = _check_file(path)
    assert fast.aux_note == notes and fast.symbol == symbol


def test_num_chan_subtype_changes(tmp_path):
    n = 12
    sample = np.arange(1, n + 1) * 250
    num = np.array([0, 0, 3, 3, 3, 127, 127, 7, 7, 7, 0, 0])  # wrann: 0..127
    chan = np.array([0, 1, 1, 1, 200, 200, 0, 0, 5, 5, 5, 5])
    subtype = np.array([0, 0, 1, 0, 0, -1, 0, 0, 2, 0, 0, 3])
    path = _write(tmp_path, "fields", sample, ["N", "V"] * (n // 2), num=num, chan=chan, subtype=subtype)
    codes = words_of(path) >> 10
    assert all(np.count_nonzero(codes == c) > 0 for c in (60, 61, 62))
    fast = _check_file(path)
    assert fast.num.tolist() == num.tolist() and fast.chan.tolist() == chan.tolist()
    assert fast.subtype.tolist() == subtype.tolist()


def _word(code: int, i: int = 0) -> bytes:
    return ((code << 10) | i).to_bytes(2, "little")


def _skip(n: int) -> bytes:
    u = n & 0xFFFFFFFF
    return _word(59) + (u >> 16).to_bytes(2, "little") + (u & 0xFFFF).to_bytes(2, "little")


def test_handmade_words_match_wfdb(tmp_path):
    """Constructs wrann does not write: negative and consecutive SKIPs, code-0 words (they
    advance the time and are removed), a CHN persisting past a code-0 word, high I bits
    that wfdb ignores in field words, a negative num."""
    data = b"".join([
        _skip(-1), _word(0, 1),            # wfdb's own 'end of definitions' construct
        _word(1, 10), _word(60, 5),         # N at 10, num 5
        _skip(2000), _skip(-500), _word(5, 7),  # V at 10 + 1500 + 7
        _word(0, 300), _word(62, 4),         # not an annotation: time moves, chan 4 persists
        _word(1, 1), _word(61, 0x3FF),        # subtype low byte 0xFF = -1
        _word(28, 2), _word(60, 0x2FE), _word(63, 3), b"(N\x00\x00",  # num: low byte, signed
        _word(0, 0),
    ])
    path = tmp_path / "hand.atr"
    path.write_bytes(data)
    fast = _check_file(path)
    assert fast.sample.tolist() == [10, 1517, 1818, 1820]
    assert fast.num.tolist() == [5, 5, 5, -2] and fast.chan.tolist() == [0, 0, 4, 4]
    assert fast.subtype.tolist() == [0, 0, -1, 0] and fast.aux_note[-1] == "(N\x00"


def test_empty_annotation_file(tmp_path):
    path = tmp_path / "empty.atr"
    path.write_bytes(_word(0, 0))
    assert read_mit_annotations(path).sample.size == 0
    _check_file(path)


@pytest.mark.parametrize("cut", [1, 2, 3, 7])
def test_truncated_file_is_left_to_wfdb(real_mitdb_dir, tmp_path, cut):
    """No end marker / odd size / AUX payload cut: None (wfdb decides, load_record names the file)."""
    data = (real_mitdb_dir / "100.atr").read_bytes()
    assert parse_mit_annotations(data[:-cut]) is None
    aux_at = 2 * int(np.flatnonzero(np.frombuffer(data, "<u2") >> 10 == 63)[0])
    assert parse_mit_annotations(data[: aux_at + 4] + _word(0, 0)) is None  # AUX payload cut


def test_load_record_on_truncated_annotations(real_mitdb_dir, tmp_path):
    d = tmp_path / "rec"
    d.mkdir()
    for ext in ("hea", "dat", "atr"):
        shutil.copyfile(real_mitdb_dir / f"100.{ext}", d / f"100.{ext}")
    data = (real_mitdb_dir / "100.atr").read_bytes()
    (d / "100.atr").write_bytes(data[:-1])  # odd size: wfdb cannot read it either
    with pytest.raises(RecordError, match=r"record 100: annotation file 100.atr is unreadable"):
        load_record(d, "100", hash_inputs=False)
    (d / "100.atr").write_bytes(data[:-2])  # end marker lost: wfdb ignores the last word
    rec = load_record(d, "100", hash_inputs=False)
    assert wfdb.rdann(str(d / "100"), "atr").sample.size == wfdb.rdann(str(real_mitdb_dir / "100"), "atr").sample.size - 1
    assert rec.annotated_beats == 2273 - 1  # as wfdb: the last beat is gone, no error


def test_definitions_and_undefined_codes_fall_back(tmp_path, mitdb_dir):
    from wfdb.io.annotation import Annotation

    sample, symbol = [100, 200, 300], ["N", "N", "N"]

    Annotation("fsw", "atr", sample=np.array(sample), symbol=symbol, fs=360).wrann(
        write_fs=True, write_dir=str(tmp_path))
    assert read_mit_annotations(tmp_path / "fsw.atr") is None  # '## time resolution' NOTE at 0
    custom = Annotation("cl", "atr", sample=np.array(sample), symbol=["N", "Z", "N"],
                        custom_labels=[(42, "Z", "custom beat")])
    custom.wrann(write_dir=str(tmp_path))
    assert read_mit_annotations(tmp_path / "cl.atr") is None  # custom label definitions
    assert wfdb.rdann(str(tmp_path / "cl"), "atr").symbol == ["N", "Z", "N"]
    data = bytearray((mitdb_dir / "100.atr").read_bytes())
    words = np.frombuffer(bytes(data), "<u2")
    i = int(np.flatnonzero(words >> 10 == 1)[0])
    data[2 * i : 2 * i + 2] = ((int(words[i]) & 0x3FF) | (45 << 10)).to_bytes(2, "little")
    assert parse_mit_annotations(bytes(data)) is None  # undefined code: wfdb gives NaN


def test_fuzzed_files_equal_wfdb_or_fall_back(mitdb_dir, tmp_path):
    """Seeded random damage to a real file: the reader equals rdann or returns None."""
    rng = np.random.default_rng(0)
    base = (mitdb_dir / "203.atr").read_bytes()[:2000] + _word(0, 0)  # 203 has AUX and SUB words
    assert read_mit_annotations(mitdb_dir / "203.atr") is not None and parse_mit_annotations(base) is not None
    path = tmp_path / "f.atr"
    answered = 0
    for _ in range(150):
        b = bytearray(base)
        for pos in rng.integers(0, len(b) - 2, size=int(rng.integers(1, 4))):
            b[int(pos)] = int(rng.integers(0, 256))
        path.write_bytes(bytes(b))
        fast = read_mit_annotations(path)
        if fast is None:
            continue
        answered += 1
        assert_same_as_wfdb(fast, wfdb.rdann(str(tmp_path / "f"), "atr"))
    assert answered > 50


def _no_rdann(*args, **kwargs):
    raise AssertionError("wfdb.rdann called")


def test_load_record_reads_without_rdann(mitdb_dir, monkeypatch):
    """The fast path is what load_record uses, and it falls back to rdann on None."""
    for sampto in (360 * 120, None):
        with monkeypatch.context() as m:  # the wfdb path, as before the fast reader
            m.setattr(records_mod, "read_mit_annotations", lambda *a, **k: None)
            ref = load_record(mitdb_dir, "201", sampto=sampto, hash_inputs=False)
        with monkeypatch.context() as m:
            m.setattr(wfdb, "rdann", _no_rdann)
            rec = load_record(mitdb_dir, "201", sampto=sampto, hash_inputs=False)
        for f in ("beat_samples", "beat_symbols", "beat_rhythms"):
            assert np.array_equal(getattr(rec, f), getattr(ref, f)), f
        assert rec.rhythms == ref.rhythms and len(rec.rhythms) >= 1 and rec.annotated_beats == ref.annotated_beats
    monkeypatch.setattr(wfdb, "rdann", _no_rdann)
    monkeypatch.setattr(records_mod, "read_mit_annotations", lambda *a, **k: None)
    with pytest.raises(RecordError, match=r"annotation file 201.atr is unreadable: AssertionError"):
        load_record(mitdb_dir, "201", sampto=360 * 120, hash_inputs=False)


@pytest.mark.parametrize(
    "words, wfdb_gives",
    [
        ([_word(1, 10), _word(60, 5), _word(60, 6), _word(1, 5)], "num of length 3 for 2 annotations"),
        ([_word(1, 10), _word(61, 1), _word(61, 2), _word(1, 5)], "subtype of length 3 for 2 annotations"),
        ([_word(60, 5), _word(1, 10)], "an annotation of code 60 (NaN symbol)"),
        ([_word(1, 10), _skip(5000), _word(62, 1), _word(1, 5)], "an annotation of code 62 (NaN symbol)"),
        ([_word(1, 10), _skip(5000)], "IndexError (the end marker read as an annotation)"),
    ],
)
def test_constructs_left_to_wfdb(tmp_path, words, wfdb_gives):
    """Words wfdb reads out of step (or not at all): the reader declines rather than guess."""
    path = tmp_path / "odd.atr"
    path.write_bytes(b"".join(words) + _word(0, 0))
    assert read_mit_annotations(path) is None
    try:
        ref = wfdb.rdann(str(tmp_path / "odd"), "atr")
    except IndexError:
        assert wfdb_gives.startswith("IndexError")
        return
    n = ref.sample.size
    if "length 3" in wfdb_gives:
        field = wfdb_gives.split()[0]
        assert n == 2 and getattr(ref, field).size == 3
    else:
        assert any(not isinstance(s, str) for s in ref.symbol)
