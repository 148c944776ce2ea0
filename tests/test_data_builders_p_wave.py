"""``p_wave_beats``'s measure: how alike the P-wave segments of the beats before a beat are."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hlmtune.data_builders import p_wave
from hlmtune.data_builders.p_wave import p_segments, p_wave_regularity, p_wave_tokens

FS, PRE, W = 128.0, 42, 128  # the shipped tokenizer: 128 Hz windows of 128 samples, R at a third


def _slow(waves, pre, fs, beats):
    """Loop by loop, from the definition (no code shared with the module)."""
    lo, hi = int(round(0.25 * fs)), int(round(0.06 * fs))
    out = []
    for j in range(len(waves)):
        if j < beats:
            out.append(math.nan)
            continue
        segs = []
        for b in range(j - beats, j):
            s = [float(x) for x in waves[b][pre - lo: pre - hi]]
            mean = sum(s) / len(s)
            segs.append([x - mean for x in s])
        med = [float(np.median([s[t] for s in segs])) for t in range(len(segs[0]))]
        mm = sum(med) / len(med)
        med = [x - mm for x in med]
        corrs = []
        for s in segs:
            den = math.sqrt(sum(x * x for x in s)) * math.sqrt(sum(x * x for x in med))
            if den > 0:
                corrs.append(sum(a * b for a, b in zip(s, med)) / den)
        out.append(float(np.median(corrs)) if corrs else math.nan)
    return np.array(out)


def _sinus(n, rng, noise=0.02):
    """(n, W) beats with one P wave 0.16 s before R (Gaussian, 0.15 mV) and a QRS, plus noise."""
    t = (np.arange(W) - PRE) / FS
    beat = 0.15 * np.exp(-((t + 0.16) / 0.025) ** 2) + 1.0 * np.exp(-(t / 0.012) ** 2)
    return beat + noise * rng.normal(size=(n, W))


def test_matches_the_slow_reference_across_chunks_and_flat_segments(monkeypatch):
    rng = np.random.default_rng(0)
    waves = np.concatenate([_sinus(40, rng), rng.normal(scale=0.05, size=(40, W))])  # sinus, then "fibrillation"
    waves[50, :] = 0.0  # a flat beat (a padded window): its correlation is unknown, not 0
    waves[60:66, :] = 0.0  # a flat context: every segment of beat 66's context is flat from 60 to 65
    monkeypatch.setattr(p_wave, "_ROWS_PER_CHUNK", 7)  # chunk edges inside the record
    for k in (3, 8, 11):
        got = p_wave_regularity(waves, pre=PRE, fs=FS, beats=k)
        np.testing.assert_allclose(got, _slow(waves, PRE, FS, k), atol=1e-12, equal_nan=True)
        assert np.isnan(got[:k]).all() and np.isfinite(got[k:40]).all()
    sinus = p_wave_regularity(waves, pre=PRE, fs=FS, beats=8)
    assert np.nanmin(sinus[8:40]) > 0.85  # the same P wave before every beat (noise 0.02 mV)
    assert np.nanmax(np.abs(sinus[49:79])) < 0.5  # noise: no shared P wave


def test_reads_only_the_earlier_beats():
    """Causal and never the target's own samples: beat j's value moves with beats j-K..j-1 only."""
    rng = np.random.default_rng(1)
    waves = _sinus(60, rng)
    base = p_wave_regularity(waves, pre=PRE, fs=FS, beats=8)
    moved = waves.copy()
    moved[30, : PRE] = rng.normal(scale=0.3, size=PRE)  # beat 30's P wave replaced by noise
    got = p_wave_regularity(moved, pre=PRE, fs=FS, beats=8)
    changed = np.flatnonzero(np.abs(got - base) > 1e-12)
    assert changed.min() > 30 and changed.max() <= 38 and changed.size > 0  # beats 31..38 read beat 30
    assert got[30] == base[30]  # its own samples are not read


def test_a_window_too_short_for_the_p_wave_is_refused():
    with pytest.raises(ValueError, match="needs 0.25 s of window before the R peak: 20 samples at 128 Hz"):
        p_segments(np.zeros((5, W)), pre=20, fs=FS)
    with pytest.raises(ValueError, match="at least 3"):
        p_wave_regularity(np.zeros((5, W)), pre=PRE, fs=FS, beats=2)
    assert p_segments(np.zeros((2, W)), pre=PRE, fs=FS).shape == (2, 32 - 8)


def test_tokens_cover_minus_one_to_one_and_unknown():
    got = p_wave_tokens(np.array([-1.0, -0.999, 0.0, 0.51, 0.999, 1.0, np.nan]), rr_base=100, rr_bins=64)
    assert got.tolist() == [100, 100, 132, 148, 163, 163, 164]
    assert p_wave_tokens(np.array([np.nan]), rr_base=100, rr_bins=64, unknown=7).tolist() == [7]
