"""Bad input, each on a copy of a real MIT-BIH record: a clear RecordError naming the
record and the problem (and a directory run that carries on, see test_ecg_pipeline)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hlmtune.ecg_tokenizer.core import tokenize_record
from hlmtune.ecg_tokenizer.records import RecordError, list_records, load_record
from hlmtune.ecg_tokenizer.vocab import TokenizerParams


def copy_record(src: Path, name: str, dst: Path, new_name: str | None = None) -> Path:
    """Copy name.{hea,dat,atr} (renaming the record inside the header when asked)."""
    dst.mkdir(parents=True, exist_ok=True)
    new = new_name or name
    for ext in ("dat", "atr"):
        shutil.copyfile(src / f"{name}.{ext}", dst / f"{new}.{ext}")
    hea = (src / f"{name}.hea").read_text()
    if new != name:
        hea = hea.replace(f"{name}.dat", f"{new}.dat").replace(name, new, 1)
    (dst / f"{new}.hea").write_text(hea)
    return dst


def test_real_record_reads_cleanly(real_mitdb_dir):
    rec = load_record(real_mitdb_dir, "100")
    assert rec.fs == 360.0 and rec.lead == "MLII" and rec.n_samples == 650_000
    assert rec.beat_source == "annotations" and rec.annotated_beats == rec.beat_samples.size == 2273
    assert rec.rhythms == ["(N"] and np.all(rec.beat_rhythms == 0)
    assert set(rec.inputs) == {"100.hea", "100.dat", "100.atr"} and all(len(v) == 64 for v in rec.inputs.values())
    assert list_records(real_mitdb_dir)[:3] == ["100", "101", "102"] and len(list_records(real_mitdb_dir)) == 48


def test_lead_fallback_and_error(real_mitdb_dir):
    rec = load_record(real_mitdb_dir, "102", sampto=3600)  # 102 has no MLII (V5, V2)
    assert rec.lead == "V5" and "lead MLII absent" in rec.notes[0]
    with pytest.raises(RecordError, match=r"record 102: lead MLII not in the record"):
        load_record(real_mitdb_dir, "102", sampto=3600, lead_fallback="error")
    assert load_record(real_mitdb_dir, "100", sampto=3600, lead="1").lead == "V5"


def _rename_leads(d: Path, name: str, leads: list) -> None:
    """Give the record's signals other names (the last field of each signal line of its header)."""
    lines = (d / f"{name}.hea").read_text().splitlines()
    for i, lead in enumerate(leads, start=1):
        lines[i] = lines[i].rsplit(None, 1)[0] + " " + lead
    (d / f"{name}.hea").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("second, want", [("II", "II"), ("ml2", "ml2"), ("mlii", "mlii"), ("V2", "I")])
def test_mlii_is_found_under_the_names_of_the_same_lead(mitdb_dir, tmp_path, second, want):
    """A 12-lead database names the limb lead MLII modifies "II" (INCART: I, II, III, ...); with the
    default fallback it is read instead of signal 0 (lead I), and the note says so. Another lead
    (V2) still falls back to signal 0; lead_fallback=error still refuses."""
    d = copy_record(mitdb_dir, "100", tmp_path)
    _rename_leads(d, "100", ["I", second])
    rec = load_record(d, "100", sampto=3600)
    assert rec.lead == want
    assert ("by another name" in rec.notes[0]) == (want != "I") and "lead MLII absent" in rec.notes[0]
    with pytest.raises(RecordError, match=r"record 100: lead MLII not in the record"):
        load_record(d, "100", sampto=3600, lead_fallback="error")
    assert load_record(d, "100", sampto=3600, lead="V5").lead == "I"  # other leads have no other names


def test_missing_dat(mitdb_dir, tmp_path):
    d = copy_record(mitdb_dir, "100", tmp_path)
    (d / "100.dat").unlink()
    with pytest.raises(RecordError, match=r"record 100: signal file 100.dat is missing"):
        load_record(d, "100")


def test_truncated_dat(real_mitdb_dir, tmp_path):
    d = copy_record(real_mitdb_dir, "101", tmp_path)
    data = (d / "101.dat").read_bytes()
    (d / "101.dat").write_bytes(data[: len(data) // 2])
    with pytest.raises(RecordError, match=r"record 101: signal file 101.dat is truncated: 975000 bytes, header implies 1950000"):
        load_record(d, "101")


def test_header_disagrees_with_signal(real_mitdb_dir, tmp_path):
    d = copy_record(real_mitdb_dir, "103", tmp_path)
    hea = (d / "103.hea").read_text()
    (d / "103.hea").write_text(hea.replace("650000", "600000", 1))  # header claims fewer samples
    with pytest.raises(RecordError, match=r"record 103: header disagrees with signal file 103.dat: file has 1950000 bytes, header implies 1800000"):
        load_record(d, "103")
    # Same size, different content: the header checksum catches it.
    (d / "103.hea").write_text(hea)
    raw = bytearray((d / "103.dat").read_bytes())
    raw[3000:3003] = bytes([raw[3000] ^ 0x5A, raw[3001], raw[3002]])
    (d / "103.dat").write_bytes(bytes(raw))
    with pytest.raises(RecordError, match=r"record 103: header disagrees with signal file: checksum of MLII is"):
        load_record(d, "103")


def test_missing_atr_detect_or_error(mitdb_dir, tmp_path):
    d = copy_record(mitdb_dir, "100", tmp_path)
    (d / "100.atr").unlink()
    with pytest.raises(RecordError, match=r"record 100: annotation file 100.atr is missing .* on_missing_annotations=error"):
        load_record(d, "100", sampto=360 * 60, on_missing_annotations="error")
    rec = load_record(d, "100", sampto=360 * 60)  # default: detector
    assert rec.beat_source == "detector" and rec.detector is None and rec.annotated_beats == 0
    truth = load_record(mitdb_dir, "100", sampto=360 * 60).beat_samples
    assert abs(rec.beat_samples.size - truth.size) <= 2 and np.all(rec.beat_symbols == -1)


def _corrupt_first_beat_code(atr: Path, code: int = 45) -> None:
    """Rewrite the annotation code of the first N beat to an undefined WFDB code."""
    b = bytearray(atr.read_bytes())
    words = np.frombuffer(bytes(b), dtype="<u2")
    i = int(np.flatnonzero((words >> 10) == 1)[0])
    b[2 * i : 2 * i + 2] = ((int(words[i]) & 0x3FF) | (code << 10)).to_bytes(2, "little")
    atr.write_bytes(bytes(b))


def test_unknown_annotation_symbol(real_mitdb_dir, tmp_path):
    d = copy_record(real_mitdb_dir, "100", tmp_path)
    _corrupt_first_beat_code(d / "100.atr")
    with pytest.raises(RecordError, match=r"record 100: unknown annotation code \(not in the WFDB code table\) at sample 77 in 100.atr"):
        load_record(d, "100")
    rec = load_record(d, "100", on_unknown_symbols="drop")
    assert rec.annotated_beats == 2273 - 1
    # dropped, and counted with its reason (the tokenizer's `dropped` of the record)
    assert rec.dropped == [{"sample": 77, "reason": "annotation code outside the WFDB table"}]


def test_an_annotation_past_the_end_is_dropped_and_counted(mitdb_dir, tmp_path):
    """PhysioNet's own files have a beat annotation one sample past the signal: that beat goes, the rest stay."""
    import wfdb

    d = copy_record(mitdb_dir, "100", tmp_path)
    ann = wfdb.rdann(str(d / "100"), "atr")
    n = wfdb.rdheader(str(d / "100")).sig_len
    wfdb.wrann("100", "atr", np.append(ann.sample, n), symbol=[*ann.symbol, "N"], write_dir=str(d))
    rec = load_record(d, "100")
    assert rec.dropped == [{"sample": n, "reason": f"annotation outside the signal ({n} samples)"}]
    assert rec.beat_samples.size == load_record(mitdb_dir, "100").beat_samples.size
    tok = tokenize_record(rec, TokenizerParams())
    assert tok.dropped[0] == rec.dropped[0] and len(tok.dropped) >= 1


def _rewrite(mitdb_dir: Path, d: Path, name: str, fn, seconds: int = 60) -> None:
    """Write record `name` into d from 100's first `seconds`, with p_signal modified by fn."""
    import wfdb

    rec = wfdb.rdrecord(str(mitdb_dir / "100"), sampto=360 * seconds)
    ann = wfdb.rdann(str(mitdb_dir / "100"), "atr", sampto=360 * seconds)
    p = fn(rec.p_signal.copy())
    wfdb.wrsamp(name, fs=360, units=rec.units, sig_name=rec.sig_name, p_signal=p, fmt=["212", "212"],
                adc_gain=[200.0, 200.0], baseline=[1024, 1024], write_dir=str(d))
    wfdb.wrann(name, "atr", ann.sample, symbol=ann.symbol, aux_note=ann.aux_note, write_dir=str(d))


def test_nan_signal(mitdb_dir, tmp_path):
    def put_nan(p):
        p[1000:1010, 0] = np.nan
        return p

    _rewrite(mitdb_dir, tmp_path, "nanrec", put_nan)
    with pytest.raises(RecordError, match=r"record nanrec: NaN \(invalid\) samples in lead MLII: 10 of 21600, first at sample 1000"):
        load_record(tmp_path, "nanrec")


def test_flat_signal(mitdb_dir, tmp_path):
    def flatten(p):
        p[:, 0] = 0.25
        return p

    _rewrite(mitdb_dir, tmp_path, "flat", flatten)
    with pytest.raises(RecordError, match=r"record flat: flat signal: lead MLII is constant"):
        load_record(tmp_path, "flat")


def test_record_shorter_than_window(mitdb_dir, tmp_path):
    _rewrite(mitdb_dir, tmp_path, "short", lambda p: p[:1000], seconds=3)
    import wfdb

    ann = wfdb.rdann(str(mitdb_dir / "100"), "atr", sampto=900)
    wfdb.wrann("short", "atr", ann.sample, symbol=ann.symbol, aux_note=ann.aux_note, write_dir=str(tmp_path))
    rec = load_record(tmp_path, "short")
    assert rec.n_samples == 1000
    tokenize_record(rec, TokenizerParams(scheme="samples", window=128))  # 1 s window fits in 2.8 s
    with pytest.raises(RecordError, match=r"record short: record is shorter than the window: 1000 samples \(2.778 s at 360 Hz\), a 1024-sample window at 128 Hz needs \d+ input samples"):
        tokenize_record(rec, TokenizerParams(scheme="samples", window=1024))


def test_detected_beats_carry_the_annotated_rhythm(mitdb_dir):
    """use_annotations=False: each detected beat gets the rhythm in force at its sample, the
    same rhythm the nearest annotated beat has (record 201 has atrial fibrillation episodes)."""
    ann = load_record(mitdb_dir, "201", sampto=360 * 150, hash_inputs=False)
    det = load_record(mitdb_dir, "201", sampto=360 * 150, hash_inputs=False, use_annotations=False)
    assert det.beat_source == "detector" and det.rhythms == ann.rhythms and "(AFIB" in det.rhythms
    nearest = np.abs(det.beat_samples[:, None] - ann.beat_samples[None, :]).argmin(axis=1)
    agree = np.mean(det.beat_rhythms == ann.beat_rhythms[nearest])
    assert agree > 0.95, agree
    assert set(det.beat_rhythms.tolist()) == set(range(len(det.rhythms)))


def test_a_bundle_branch_block_beat_of_another_database_is_an_n_beat(mitdb_dir, tmp_path):
    """`B` (bundle branch block beat, unspecified) is no MIT-BIH symbol; the WFDB table has it and
    AAMI EC57 groups it with N (ecg_tokenizer.labels): with the strict default it tokenizes, as N."""
    import wfdb

    from hlmtune.ecg_tokenizer.labels import AAMI_MAP

    d = copy_record(mitdb_dir, "100", tmp_path)
    ann = wfdb.rdann(str(d / "100"), "atr")
    beats = [i for i, s in enumerate(ann.symbol) if s == "N"]
    symbols = list(ann.symbol)
    symbols[beats[5]] = "B"
    wfdb.wrann("100", "atr", ann.sample, symbol=symbols, aux_note=ann.aux_note, write_dir=str(d))
    rec = load_record(d, "100")  # on_unknown_symbols="error" by default: B is known
    tok = tokenize_record(rec, TokenizerParams())
    at = int(np.flatnonzero(tok.beats["sample"] == ann.sample[beats[5]])[0])
    from hlmtune.ecg_tokenizer.core import get_vocab

    n_id = get_vocab(TokenizerParams()).classes.index("N")
    assert AAMI_MAP["B"] == "N" and int(tok.beats["label"][at]) == n_id and not rec.dropped


def test_second_lead_is_the_other_signal(real_mitdb_dir):
    """``second_lead``: the first signal other than the chosen lead, read and checked like it."""
    import wfdb

    rec = load_record(real_mitdb_dir, "100", sampto=3600, second_lead=True)  # MLII, V5
    raw = wfdb.rdrecord(str(real_mitdb_dir / "100"), physical=False, sampto=3600)
    assert rec.lead == "MLII" and rec.lead2 == "V5" and rec.gain2_per_mv == 200.0
    assert np.array_equal(rec.signal2, raw.d_signal[:, 1]) and np.array_equal(rec.signal, raw.d_signal[:, 0])
    assert rec.without_signal().signal2.size == 0
    # MLII second in the file (114: V5, MLII): the second lead is signal 0
    rec = load_record(real_mitdb_dir, "114", sampto=3600, second_lead=True)
    assert (rec.lead, rec.lead2) == ("MLII", "V5")
    # a fallback first lead (102: V5, V2, no MLII): the second lead is the next signal
    assert load_record(real_mitdb_dir, "102", sampto=3600, second_lead=True).lead2 == "V2"
    assert load_record(real_mitdb_dir, "100", sampto=3600).signal2 is None  # off by default


def test_second_lead_errors_name_the_record(mitdb_dir, tmp_path):
    import wfdb

    rec = wfdb.rdrecord(str(mitdb_dir / "100"), sampto=360 * 20)
    ann = wfdb.rdann(str(mitdb_dir / "100"), "atr", sampto=360 * 20)
    wfdb.wrsamp("one", fs=360, units=["mV"], sig_name=["MLII"], p_signal=rec.p_signal[:, :1], fmt=["212"],
                adc_gain=[200.0], baseline=[1024], write_dir=str(tmp_path))
    wfdb.wrann("one", "atr", ann.sample, symbol=ann.symbol, write_dir=str(tmp_path))
    assert load_record(tmp_path, "one").lead == "MLII"  # one lead is fine without second_lead
    with pytest.raises(RecordError, match=r"record one: second_lead needs a second signal: the record has one \(MLII\)"):
        load_record(tmp_path, "one", second_lead=True)

    def flatten_second(p):
        p[:, 1] = 0.25
        return p

    _rewrite(mitdb_dir, tmp_path, "flat2", flatten_second)
    load_record(tmp_path, "flat2")
    with pytest.raises(RecordError, match=r"record flat2: flat signal: lead V\d is constant"):
        load_record(tmp_path, "flat2", second_lead=True)
