"""The rhythm feature tokens against slow, loop-by-loop references on real (or stand-in) beat tables."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from hlmtune.data_builders.rr_features import (
    NORMAL_RR_S, gated_reference, interval_tokens, local_average_rr, long_reference, normalized_rr_tokens,
    rhythm_irregularity, running_irregularity, running_reference, window_average_rr,
)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    from hlm_fixtures import make_shards
    from hlmtune.ecg_tokenizer.shards import read_manifest, stem
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer

    info = make_shards(tmp_path_factory.mktemp("rr"))
    m = read_manifest(info["shards"])
    out = []
    for r in m["records"][:3]:
        out.append((np.load(info["shards"] / "records" / f"{stem(r['record'])}.beats.npy"), float(r["fs"])))
    return out, ECGTokenizer(manifest_path=str(info["shards"])).vocab


def _known(rr):
    return [float(x) if x > 0 else None for x in rr]


def test_running_reference_mean_and_median_use_only_earlier_beats(tables):
    tabs, _ = tables
    for t, _ in tabs:
        rr = _known(t["rr"])
        for stat, fn in (("median", statistics.median), ("mean", statistics.fmean)):
            got = running_reference(t, 16, stat)
            for i in range(0, len(rr), 7):
                window = [x for x in rr[max(0, i - 15): i + 1] if x is not None]
                assert (math.isnan(got[i]) if not window else math.isclose(got[i], fn(window), rel_tol=1e-12)), (stat, i)
    t2 = tabs[0][0].copy()
    t2["rr"][50:] = 999  # later beats do not move the reference of earlier ones
    assert np.array_equal(running_reference(t2, 16, "mean")[:50], running_reference(tabs[0][0], 16, "mean")[:50],
                          equal_nan=True)  # a record's first beat has no interval


def test_local_and_window_averages_span_earlier_and_following_beats(tables):
    tabs, _ = tables
    for t, fs in tabs:
        rr, s = _known(t["rr"]), [int(x) for x in t["sample"]]
        loc, win = local_average_rr(t, 10), window_average_rr(t, 60.0, fs)
        for i in range(0, len(rr), 5):
            near = [x for x in rr[max(0, i - 5): i + 5] if x is not None]  # 5 before, the beat, 4 after
            assert math.isclose(loc[i], statistics.fmean(near), rel_tol=1e-12) if near else math.isnan(loc[i])
            within = [x for x, at in zip(rr, s) if x is not None and abs(at - s[i]) <= 30.0 * fs]
            assert math.isclose(win[i], statistics.fmean(within), rel_tol=1e-12) if within else math.isnan(win[i])
        t2 = t.copy()
        t2["rr"][len(t) // 2 + 10:] = 999  # a following beat moves the surrounding averages, on purpose
        assert local_average_rr(t2, 10)[len(t) // 2 + 6] != loc[len(t) // 2 + 6]


def test_tokens_are_the_bins_of_seconds_or_of_ratios(tables):
    tabs, vocab = tables
    p = vocab.params
    width = (p.rr_max_s - p.rr_min_s) / p.rr_bins
    secs = np.array([0.1, 0.5, 1.0, 5.0, np.nan])
    want = [0, int((0.5 - p.rr_min_s) // width), int((1.0 - p.rr_min_s) // width), p.rr_bins - 1, p.rr_bins]
    assert (interval_tokens(secs, vocab, None) - vocab.rr_base).tolist() == want
    t, _ = tabs[0]
    ref = running_reference(t, 32, "mean")
    got = normalized_rr_tokens(t, vocab, 32, "mean")
    for i in range(0, len(t), 9):
        if t["rr"][i] <= 0:
            assert got[i] == vocab.rr_base + p.rr_bins
            continue
        ratio_s = NORMAL_RR_S * float(t["rr"][i]) / ref[i]
        b = min(p.rr_bins - 1, max(0, int((ratio_s - p.rr_min_s) // width)))
        assert got[i] - vocab.rr_base == b, i


def _quantile_by_hand(values, q):
    """Linear-interpolation quantile of a list (numpy's default method), by sorting."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def test_long_reference_is_the_upper_quartile_of_earlier_beats_only(tables, monkeypatch):
    import hlmtune.data_builders.rr_features as rf

    monkeypatch.setattr(rf, "_ROWS_PER_CHUNK", 37)  # several chunks per record, one of them partial
    tabs, _ = tables
    for t, _ in tabs:
        rr = _known(t["rr"])
        got = long_reference(t, 40)
        assert got.shape == (len(rr),)
        for i in range(0, len(rr), 3):
            window = [x for x in rr[max(0, i - 39): i + 1] if x is not None]
            want = _quantile_by_hand(window, 0.75) if window else float("nan")
            assert (math.isnan(got[i]) if not window else math.isclose(got[i], want, rel_tol=1e-12)), i
    t2 = tabs[0][0].copy()
    t2["rr"][60:] = 1  # later beats (a fast run) do not move the reference of earlier ones
    assert np.array_equal(long_reference(t2, 40)[:60], long_reference(tabs[0][0], 40)[:60], equal_nan=True)
    with pytest.raises(ValueError, match="beats >= 1"):
        long_reference(t2, 0)


def test_the_long_reference_keeps_the_usual_rhythm_through_an_ectopic_run():
    """The case it is for: a run of fast beats filling 60% of the window stays early against it."""
    rr = np.array([-1] + [100] * 400 + [50] * 600, np.int64)  # 100 samples usual, then a 600-beat run at 50
    t = np.zeros(rr.size, [("rr", "<i4"), ("sample", "<i8")])
    t["rr"] = rr
    long, median = long_reference(t, 1000), running_reference(t, 256, "median")
    assert long[-1] == 100 and median[-1] == 50  # the median took the run as the rhythm; the quartile did not


def _irregularity_by_hand(known):
    """median |successive difference| / median of a list, by statistics (inf under 3 values)."""
    if len(known) < 3:
        return float("inf")
    return statistics.median([abs(b - a) for a, b in zip(known, known[1:])]) / statistics.median(known)


def _gated_by_hand(rr, beats, early=0.8, pause=1.3, slower=4, open_above=None, rhythm=16):
    """The gated reference beat by beat: a plain list of accepted intervals, its median by statistics."""
    accepted, streak, ref, out, seen = [], [], None, [], []
    for x in rr:
        if x is not None:
            seen.append(x)
            irregular = open_above is not None and _irregularity_by_hand(seen[-rhythm:]) > open_above
            if ref is None or irregular or early * ref <= x <= pause * ref:
                accepted.append(x)
                streak = []
            elif x > pause * ref:
                streak.append(x)
                if len(streak) == slower:
                    accepted, streak = list(streak), []
            else:
                streak = []
            ref = statistics.median(accepted[-beats:])
        out.append(float("nan") if ref is None else ref)
    return out


def _table(rr):
    t = np.zeros(len(rr), [("rr", "<i4"), ("sample", "<i8")])
    t["rr"] = rr
    t["sample"] = np.cumsum(np.maximum(t["rr"], 0))
    return t


def test_gated_reference_matches_a_slow_reference_and_reads_earlier_beats_only(tables):
    tabs, vocab = tables
    for t, _ in tabs:
        for beats in (1, 8, 32):
            got = gated_reference(t, beats)
            want = _gated_by_hand(_known(t["rr"]), beats)
            assert np.allclose(got, want, rtol=1e-12, equal_nan=True), beats
        assert np.array_equal(running_reference(t, 32, "gated"), gated_reference(t, 32), equal_nan=True)
    # Real beat tables hold few pauses and early beats: a drawn rhythm exercises every branch.
    rng = np.random.default_rng(0)
    rr = (100 * np.exp(rng.normal(0, 0.25, 3000))).astype(int)
    rr[::97] = -1  # unknown intervals keep the reference
    assert np.allclose(gated_reference(_table(rr), 16), _gated_by_hand(_known(rr), 16), rtol=1e-12, equal_nan=True)
    t2 = _table(rr)
    t2["rr"][500:] = 20  # later beats do not move the reference of earlier ones
    assert np.array_equal(gated_reference(t2, 16)[:500], gated_reference(_table(rr), 16)[:500], equal_nan=True)
    t0 = tabs[0][0]
    assert np.array_equal(normalized_rr_tokens(t0, vocab, 32, "gated"),
                          interval_tokens(np.where(t0["rr"] > 0, t0["rr"], np.nan).astype(float), vocab,
                                          gated_reference(t0, 32)))
    with pytest.raises(ValueError, match="beats >= 1"):
        gated_reference(t0, 0)


def test_the_gated_reference_follows_a_gradual_speed_up_but_not_an_abrupt_run():
    """What it is for: a run that starts with a jump stays early; a sinus rhythm speeding up is followed."""
    run = _table([-1] + [100] * 400 + [50] * 600 + [100] * 50)  # usual 100 samples, a 600-beat run at 50
    gated, median = gated_reference(run, 32), running_reference(run, 256, "median")
    assert gated[1000] == 100 and median[1000] == 50  # the median took the run as the rhythm
    assert gated[-1] == 100
    ramp = _table([-1] + [100] * 100 + np.linspace(100, 60, 400).astype(int).tolist())  # 0.13% a beat
    assert gated_reference(ramp, 32)[-1] <= 62  # followed to within a few percent
    # A pause is left out; four in a row are a slower rhythm, adopted at the fourth.
    pauses = _table([-1] + [100] * 50 + [150] + [100] * 10 + [200] * 6)
    ref = gated_reference(pauses, 32)
    assert ref[51] == 100 and ref[64] == 100 and ref[65] == 200 and ref[-1] == 200  # pauses from index 62
    # A record that begins inside a fast run: the slower usual rhythm after it becomes the reference.
    start = _table([-1] + [50] * 100 + [100] * 20 + [50] * 30)
    ref = gated_reference(start, 32)
    assert ref[100] == 50 and ref[103] == 50 and ref[104] == 100 and ref[-1] == 100  # the second run is early


def test_rhythm_irregularity_by_hand():
    assert rhythm_irregularity([0.8, 0.8, 0.8, 0.8]) == 0.0
    assert rhythm_irregularity([0.8, 1.0, 0.8, 1.0]) == pytest.approx(0.2 / 0.9)  # alternating: irregular
    assert rhythm_irregularity([1.0, 1.0]) == float("inf")  # too few intervals to tell
    # one premature beat and its pause do not make a regular rhythm irregular (median, not mean)
    assert rhythm_irregularity([1.0] * 7 + [0.6, 1.4] + [1.0] * 7) == 0.0


def test_running_irregularity_matches_a_slow_reference_over_known_intervals(tables):
    tabs, _ = tables
    rng = np.random.default_rng(2)
    rr = (100 * np.exp(rng.normal(0, 0.2, 400))).astype(int)
    rr[[0, 1, 50, 51, 52, 300]] = -1  # unknown intervals are skipped, not counted
    for t in [tt for tt, _ in tabs] + [_table(rr)]:
        known, got = _known(t["rr"]), running_irregularity(t, 16)
        for i in range(len(known)):
            seen = [x for x in known[: i + 1] if x is not None][-16:]
            want = _irregularity_by_hand(seen)
            assert got[i] == want or math.isclose(got[i], want, rel_tol=1e-12), i
    with pytest.raises(ValueError, match="beats >= 3"):
        running_irregularity(tabs[0][0], 2)


def test_gated_regular_matches_a_slow_reference_and_opens_the_gate_in_an_irregular_rhythm(tables):
    tabs, _ = tables
    rng = np.random.default_rng(3)
    # regular stretches with an ectopic run, then fibrillation, then regular again
    rr = np.concatenate([np.full(300, 100), np.full(200, 50), (100 * np.exp(rng.normal(0, 0.3, 1500))),
                         np.full(300, 90)]).astype(int)
    rr[::131] = -1
    for t in [tt for tt, _ in tabs] + [_table(rr)]:
        got = running_reference(t, 32, "gated_regular")
        want = _gated_by_hand(_known(t["rr"]), 32, open_above=0.2)
        assert np.allclose(got, want, rtol=1e-12, equal_nan=True)
    t = _table(rr)
    gated, regular = gated_reference(t, 32), running_reference(t, 32, "gated_regular")
    assert regular[499] == 100 and gated[499] == 100  # the run (regular) stays early against both
    fib = slice(900, 2000)
    # in fibrillation the always-on gate keeps short intervals out and drifts up to the long ones;
    # the open gate stays at the rhythm's median
    assert np.median(gated[fib]) > 1.08 * np.median(rr[fib]) and abs(np.median(regular[fib]) / np.median(rr[fib]) - 1) < 0.03
