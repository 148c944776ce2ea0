"""Fast (vectorised) tokenizer == slow reference on real MIT-BIH records; beat accounting."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hlmtune.ecg_tokenizer.core import get_vocab, tokenize_record
from hlmtune.ecg_tokenizer.labels import BEAT_SYMBOLS, label_classes, symbol_to_class
from hlmtune.ecg_tokenizer.records import load_record
from hlmtune.ecg_tokenizer.reference import tokenize_record_reference
from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer
from hlmtune.ecg_tokenizer.vocab import TokenizerParams

PARAMS = [
    TokenizerParams(),  # samples, 128 @ 128 Hz, mu-law 256, 16 RR bins, AAMI
    TokenizerParams(window=1024, quantization="uniform", levels=1024, label_mode="raw", target_rate=250.0, rr_bins=0),
    TokenizerParams(window=201, target_rate=360.0, levels=64, amplitude_mv=2.0),  # odd window
    TokenizerParams(scheme="annotation", rr_bins=16),
    TokenizerParams(scheme="annotation", rr_bins=0, label_mode="raw"),
]
# Normal; ventricular bigeminy; AF/AFL; F and V beats; long pauses and APBs.
SLICES = ["100", "119", "201", "208", "232"]


@pytest.fixture(scope="module")
def sliced(mitdb_dir):
    return {n: load_record(mitdb_dir, n, sampto=360 * 150) for n in SLICES}


def _same(a, b):
    assert np.array_equal(a.tokens, b.tokens) and a.tokens.dtype == b.tokens.dtype
    assert np.array_equal(a.beats, b.beats)
    assert a.dropped == b.dropped


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"{p.scheme}-{p.window}-{p.target_rate:g}-{p.quantization}")
def test_fast_equals_reference_on_slices(sliced, p):
    for rec in sliced.values():
        _same(tokenize_record(rec, p), tokenize_record_reference(rec, p))


def test_fast_equals_reference_full_record(real_mitdb_dir):
    rec = load_record(real_mitdb_dir, "222")  # AF, AFL, nodal rhythm; the whole 30 min
    p = TokenizerParams()
    fast = tokenize_record(rec, p)
    _same(fast, tokenize_record_reference(rec, p))
    assert fast.beats.size == 2483 - len(fast.dropped)


@pytest.mark.parametrize("name", ["100", "106", "203", "207"])
def test_beat_counts_and_labels_match_annotations(mitdb_dir, name):
    """Kept + dropped == beat annotations of the .atr; labels per record match."""
    import wfdb

    ann = wfdb.rdann(str(mitdb_dir / name), "atr")
    beats = [(s, sym) for s, sym in zip(ann.sample, ann.symbol) if sym in BEAT_SYMBOLS]
    rec = load_record(mitdb_dir, name)
    for p in (TokenizerParams(), TokenizerParams(window=1024), TokenizerParams(scheme="annotation")):
        tok = tokenize_record(rec, p)
        assert tok.beats.size + len(tok.dropped) == len(beats)
        dropped = {d["sample"] for d in tok.dropped}
        if p.scheme == "annotation":
            assert not dropped
        else:  # only beats near either end of the record are dropped
            assert all(s < 1000 or s > rec.n_samples - 3000 for s in dropped)
            assert all(d["reason"].startswith("window") for d in tok.dropped)
        classes = label_classes("aami")
        s2c = symbol_to_class("aami")
        want = Counter(classes[s2c[sym]] for s, sym in beats if int(s) not in dropped)
        got = Counter(classes[i] for i in tok.beats["label"])
        assert got == want
        assert np.array_equal(tok.beats["sample"], [s for s, _ in beats if int(s) not in dropped])
        # the token stream is <bos> beats <eos> with each beat starting where the table says
        v = get_vocab(p)
        assert tok.tokens[0] == 1 and tok.tokens[-1] == 2
        if p.scheme == "samples":
            assert np.all(tok.tokens[tok.beats["token_start"]] == 3)
            assert np.array_equal(tok.tokens[tok.beats["token_start"] + 1] - v.rr_base, tok.beats["rr_bin"])
            # no label token anywhere in a samples stream (labels live in the beat table)
            assert not np.any((tok.tokens >= v.label_base) & (tok.tokens < v.rr_base))


def test_af_rhythm_metadata(real_mitdb_dir):
    rec = load_record(real_mitdb_dir, "201")
    tok = tokenize_record(rec, TokenizerParams(scheme="annotation"))
    names = [rec.rhythms[i] for i in tok.beats["rhythm"]]
    assert "(AFIB" in rec.rhythms and names.count("(AFIB") > 500


def test_other_sampling_rate_gives_same_waveforms(mitdb_dir, tmp_path):
    """A 250 Hz copy of record 100 tokenizes to (nearly) the same canonical beats."""
    import wfdb
    from scipy.signal import resample_poly

    secs = 120
    src = wfdb.rdrecord(str(mitdb_dir / "100"), sampto=360 * secs)
    ann = wfdb.rdann(str(mitdb_dir / "100"), "atr", sampto=360 * secs)
    p250 = resample_poly(src.p_signal, 25, 36, axis=0)
    wfdb.wrsamp("r250", fs=250, units=src.units, sig_name=src.sig_name, p_signal=p250, fmt=["16", "16"],
                adc_gain=[1000.0, 1000.0], baseline=[0, 0], write_dir=str(tmp_path))
    samples = np.round(ann.sample * 250 / 360).astype(np.int64)
    wfdb.wrann("r250", "atr", samples, symbol=ann.symbol, aux_note=ann.aux_note, write_dir=str(tmp_path))
    a = load_record(mitdb_dir, "100", sampto=360 * secs)
    b = load_record(tmp_path, "r250")
    assert b.fs == 250.0 and b.beat_samples.size == a.beat_samples.size
    p = TokenizerParams(quantization="uniform", levels=1024)
    ta, tb = tokenize_record(a, p), tokenize_record(b, p)
    _same(tb, tokenize_record_reference(b, p))
    common = np.intersect1d(np.round(ta.beats["sample"] * 250 / 360), tb.beats["sample"])
    assert common.size >= ta.beats.size - 2
    tk = ECGTokenizer(**p.to_dict())
    wa, wb = tk.decode(ta.tokens).waveforms, tk.decode(tb.tokens).waveforms
    ia = np.isin(np.round(ta.beats["sample"] * 250 / 360), common)
    ib = np.isin(tb.beats["sample"], common)
    err = np.abs(wa[ia] - wb[ib])
    # R-peak rounding (<= 1.4 ms at 360 Hz) and two different filters: small differences only.
    assert np.median(err) < 0.02 and np.percentile(err, 99) < 0.25
