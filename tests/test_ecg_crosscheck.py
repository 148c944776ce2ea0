"""The ECG tokenizer checked against code it does not share: wfdb, scipy and published definitions.

The tokenizer's reference implementation reuses the fast path's building blocks (resampler
taps, quantizer edges, RR bins, label map, R-peak rounding), so fast == reference cannot catch
a mistake in those. Here every expected value is recomputed from wfdb's physical signal and
annotations, ``scipy.signal.resample_poly`` / ``firwin`` and the definitions the docs publish
(docs/ecg_tokenizer.md: Kaiser beta 5 with 5 zero crossings per side, window starting W // 3
samples before the R peak, median baseline, mu-law (mu 255) over +-3 mV in 256 levels decoded
to bin midpoints, 16 RR bins over [0.2, 2.0] s, the AAMI mapping and class totals of
$HLM_DATA/README.md). The tokenizer is only driven through its public API (load, tokenize,
``ECGTokenizer.decode``). Nothing is imported from its resampler, vocab edges, bins or labels.

Per-record published beat tables (PhysioNet's MIT-BIH directory, "Table of beat types") are not
available offline here: per-record counts are checked against wfdb's annotation files with the
published AAMI mapping, and the per-split and whole-database totals against the README.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from hlmtune.ecg_tokenizer.core import tokenize_record
from hlmtune.ecg_tokenizer.records import load_record
from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer

W, RATE, MU, LEVELS, AMP = 128, 128, 255.0, 256, 3.0  # the documented defaults
# $HLM_DATA/README.md (MIT-BIH Arrhythmia Database; de Chazal et al. 2004 split).
AAMI = {**dict.fromkeys("NLRej", "N"), **dict.fromkeys("AaJS", "S"), **dict.fromkeys("VE", "V"),
        "F": "F", **dict.fromkeys("/fQ", "Q")}
DS1 = "101 106 108 109 112 114 115 116 118 119 122 124 201 203 205 207 208 209 215 220 223 230".split()
DS2 = "100 103 105 111 113 117 121 123 200 202 210 212 213 214 219 221 222 228 231 232 233 234".split()
PUBLISHED = {
    "all": {"N": 90_631, "S": 2_781, "V": 7_236, "F": 803, "Q": 8_043},
    "DS1": {"N": 45_866, "S": 944, "V": 3_788, "F": 415, "Q": 8},
    "DS2": {"N": 44_259, "S": 1_837, "V": 3_221, "F": 388, "Q": 7},
}


def _mulaw_edges_mv() -> np.ndarray:
    """Bin edges (mV) of mu-law quantization: uniform in F(x) = sgn(x) ln(1 + mu|x|) / ln(1 + mu), x = v / A."""
    y = np.linspace(-1.0, 1.0, LEVELS + 1)
    return np.sign(y) * AMP * np.expm1(np.abs(y) * np.log1p(MU)) / MU


def _physical_resampled(real_mitdb_dir, name: str):
    """wfdb's physical MLII signal resampled to 128 Hz with resample_poly and the documented filter."""
    import wfdb
    from scipy import signal

    rec = wfdb.rdrecord(str(real_mitdb_dir / name))
    x = rec.p_signal[:, rec.sig_name.index("MLII")]
    ratio = Fraction(RATE, int(rec.fs))
    up, down = ratio.numerator, ratio.denominator
    m = max(up, down)
    # scipy's own design for resample_poly (Kaiser-windowed sinc, cutoff 1 / max(up, down)),
    # with 5 zero crossings per side instead of its default 10; then, as documented, every
    # polyphase branch scaled to unit DC gain (resample_poly multiplies the taps by `up`).
    taps = signal.firwin(2 * 5 * m + 1, 1.0 / m, window=("kaiser", 5.0))
    for j in range(up):
        taps[j::up] /= taps[j::up].sum() * up
    return signal.resample_poly(x, up, down, window=taps), up, down, rec


@pytest.fixture(scope="module")
def record_100(real_mitdb_dir):
    rec = load_record(real_mitdb_dir, "100")
    tok = ECGTokenizer()  # samples scheme, documented defaults
    out = tokenize_record(rec, tok.params)
    return rec, out, tok.decode(out.tokens.tolist())


def test_decoded_windows_match_scipy_resampling_of_wfdb_physical_signal(real_mitdb_dir, record_100):
    _, out, dec = record_100
    y, up, down, _ = _physical_resampled(real_mitdb_dir, "100")
    assert (dec.waveforms.shape[1], out.beats.size) == (W, dec.waveforms.shape[0])
    edges = _mulaw_edges_mv()
    worst = 0.0
    for r, got in zip(out.beats["sample"], dec.waveforms):
        c = (2 * int(r) * up + down) // (2 * down)  # canonical sample nearest the R peak (no ties: 45 is odd)
        win = y[c - W // 3: c - W // 3 + W]
        truth = win - np.median(win)  # median baseline, mV
        k = np.clip(np.searchsorted(edges, truth, side="right") - 1, 0, LEVELS - 1)
        half = (edges[k + 1] - edges[k]) / 2
        inside = np.abs(truth) <= AMP
        # A value on a bin edge may land in the neighbouring bin (taps rounded to integers in the
        # tokenizer): allow that bin's half width (mu-law: adjacent widths differ by 4.4%).
        err = np.abs(got - truth)[inside]
        assert np.all(err <= 1.05 * half[inside] + 1e-6), float((err / half[inside]).max())
        # Clipped values decode to the end bin's midpoint, on the right side.
        ends = (edges[-1] + edges[-2]) / 2
        assert np.allclose(np.abs(got[~inside]), ends) and np.all(np.sign(got[~inside]) == np.sign(truth[~inside]))
        worst = max(worst, float((err / half[inside]).max(initial=0.0)))
    assert worst <= 1.05


def test_r_peak_sits_at_index_w_over_3(record_100):
    """Record 100 is mostly normal beats with tall R waves: the decoded maximum is the R peak."""
    _, out, dec = record_100
    offsets = Counter((dec.waveforms.argmax(axis=1) - W // 3).tolist())
    (mode, n_mode), = offsets.most_common(1)
    # Annotated R peaks and the 128 Hz grid: most maxima exactly at W // 3, the rest one late.
    assert mode == 0 and n_mode > 0.8 * out.beats.size, offsets.most_common(5)
    assert offsets[0] + offsets[1] + offsets[-1] > 0.97 * out.beats.size, offsets.most_common(5)


def test_rr_bins_of_known_intervals(real_mitdb_dir, record_100):
    import wfdb

    _, out, dec = record_100
    ann = wfdb.rdann(str(real_mitdb_dir / "100"), "atr")
    beats = np.array([s for s, sym in zip(ann.sample, ann.symbol) if sym in AAMI])
    rr = np.diff(beats)  # samples at 360 Hz
    # 16 equal bins over [0.2, 2.0] s, clipped: bin = floor((rr / 360 - 0.2) / 0.1125)
    # = floor((2 rr - 144) / 81) in exact integers.
    expect = dict(zip(beats[1:].tolist(), np.clip((2 * rr - 144) // 81, 0, 15).tolist()))
    got = dict(zip(out.beats["sample"].tolist(), dec.rr_bins))
    common = [s for s in got if s in expect]
    assert len(common) > 2000
    assert [got[s] for s in common] == [expect[s] for s in common]
    # A known interval through the public encode/decode API: 0.8 s -> bin 5, centre 0.81875 s.
    tok = ECGTokenizer()
    ids = tok.encode_beats(waveforms=np.zeros((1, W)), rr_s=[0.8])
    d = tok.decode(ids)
    assert d.rr_bins == [5] and d.rr_s[0] == pytest.approx(0.2 + 5.5 * 0.1125)


@pytest.fixture(scope="module")
def decoded_classes(real_mitdb_dir):
    """Class names per record, from the annotation scheme's tokens decoded by the public API."""
    tok = ECGTokenizer(scheme="annotation")
    names = sorted(p.stem for p in real_mitdb_dir.glob("*.atr"))
    return {n: Counter(tok.decode(tokenize_record(load_record(real_mitdb_dir, n), tok.params).tokens.tolist()).labels)
            for n in names}


def test_class_counts_per_record_match_wfdb_annotations(real_mitdb_dir, decoded_classes):
    import wfdb

    assert len(decoded_classes) == 48
    for name, got in decoded_classes.items():
        ann = wfdb.rdann(str(real_mitdb_dir / name), "atr")
        expect = Counter(AAMI[s] for s in ann.symbol if s in AAMI)
        assert got == expect, name


def test_class_totals_match_the_published_split_tables(decoded_classes):
    def total(names):
        c = Counter()
        for n in names:
            c.update(decoded_classes[n])
        return dict(c)

    assert total(decoded_classes) == PUBLISHED["all"]
    assert total(DS1) == PUBLISHED["DS1"]
    assert total(DS2) == PUBLISHED["DS2"]
