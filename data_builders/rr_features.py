"""RR-interval features of the beat prompt: the published inter-patient rhythm features as tokens.

The classic inter-patient feature sets describe a beat's timing by four intervals (de Chazal
et al. 2004, "Automatic classification of heartbeats using ECG morphology and heartbeat
interval features", IEEE TBME 51(7)): the **pre-RR** interval (this beat's), the **post-RR**
interval (the next beat's), a **local average** RR of the surrounding ten beats and an
**average RR** over the surrounding five minutes; Mondejar-Guerra et al. (2019) use the same,
also divided by the record's mean. The prompt's RR tokens carry the first two (the target's
own and ``next_rr``); this module computes every RR token a prompt shows, from the beat table
alone (beat positions and intervals, never a label):

* the running reference of ``normalized_rr``: the **median** (default) or the **mean** of the
  last N intervals, this beat's included (causal), or the **gated** median of the last N
  intervals that were neither early nor pauses (:func:`gated_reference`: a rhythm that speeds up
  gradually moves it, an abrupt ectopic run does not);
* ``local_rr``: the mean of the known intervals of the N beats around the target (N // 2
  before it, the target, and (N - 1) // 2 after it: surrounding beats, as de Chazal's);
* ``average_rr_s``: the mean of the known intervals of the beats within W / 2 seconds before
  or after the target beat (surrounding minutes, as de Chazal's five);
* ``long_rr``: the beat's own interval against the **upper quartile** of the last N known
  intervals (causal; :func:`long_reference`), the patient's slower usual rhythm.

Each interval is written as an RR token: absolute (seconds) without ``normalized_rr``, else as
its ratio to the running reference, at a standard cycle of :data:`NORMAL_RR_S` (as the beat's
own interval is).
"""

from __future__ import annotations

import warnings
from bisect import bisect_left, insort
from collections import deque
from typing import Optional

import numpy as np

from hlmtune.ecg_tokenizer.vocab import Vocabulary, rr_bin, rr_edges

NORMAL_RR_S = 0.8  # 75 bpm: the interval a normalized RR token is written at
RR_REFERENCES = ("median", "mean", "gated", "gated_regular")
# ``rr_reference: gated`` (gated_reference): which intervals are the patient's usual rhythm. An
# interval under GATE_EARLY x the reference came early (an ectopic beat, or the first of an ectopic
# run; AAMI's prematurity is judged against the underlying rhythm), one over GATE_PAUSE x is a
# pause (compensatory or a dropped beat); neither enters the reference. A sinus rhythm changes by
# a few percent a beat, so it stays inside the gate and is followed; an ectopic run starts with a
# jump and stays out. GATE_SLOWER consecutive pauses are a slower rhythm (a record that began
# inside a run, a block), adopted at once. Chosen on the 61 training patients' annotations
# (DS1 + svdb) before any run, from gates 0.8 / 0.88 and 1.3 / none over windows of 8 / 32 / 128
# accepted intervals and GATE_SLOWER 3 / 4 / 6: the fewest N beats early (ratio under 0.88) against
# the reference, 6.4% with 96% of S beats (the running median of 256: 4.7% and 73%).
GATE_EARLY = 0.8
GATE_PAUSE = 1.3
GATE_SLOWER = 4
# ``rr_reference: gated_regular``: the gate is open (every interval enters) while the rhythm is
# irregular, rhythm_irregularity of the last GATE_RHYTHM_BEATS known intervals above
# GATE_IRREGULAR. In an irregular rhythm (fibrillation, marked sinus arrhythmia) no interval is
# "early" against the patient's usual one, and a gate that keeps out only short intervals drifts
# up to the long ones: svdb/867's N beats, 1,718 of them early against ``gated``. DS1's
# fibrillating N beats have an irregularity of 0.15-0.45 (10th-90th percentiles, median 0.27:
# ECGBeatClassificationDataset.IRREGULAR_SIGMA), sinus rhythm a few percent. Over the 61 training
# patients' annotations, gates opening above 0.05 / 0.08 / 0.12 / 0.2 (counted before any run with
# it): 0.2 kept the most S beats early (93%, all of svdb/865's) of those with fewer N beats early
# than the 256-beat median (3.9% against 4.7%).
GATE_IRREGULAR = 0.2
GATE_RHYTHM_BEATS = 16
# ``long_rr``'s reference: the upper quartile of a long window. A running median adopts an
# ectopic rhythm once it fills half its window (svdb/865: runs of up to 665 S beats at 0.42 s
# amid a 0.8 s sinus rhythm, so 9% of its S beats come early by the 256-beat median); the upper
# quartile stays at the slower usual rhythm while that rhythm fills at least a quarter of the
# window.
LONG_RR_QUANTILE = 0.75
_ROWS_PER_CHUNK = 4096  # windows sorted at once by long_reference: (4096, beats) floats, bounded memory


def _known(table: np.ndarray) -> np.ndarray:
    """(n,) float RR of each beat in input samples, NaN where unknown (a record's first beat)."""
    rr = table["rr"].astype(np.float64)
    rr[rr <= 0] = np.nan
    return rr


def running_reference(table: np.ndarray, beats: int, stat: str = "median") -> np.ndarray:
    """(n,) the running median or mean of the last ``beats`` known intervals (input samples), NaN before any.

    ``gated`` is :func:`gated_reference` (the median of the last ``beats`` usual-rhythm intervals),
    ``gated_regular`` the same with the gate open while the rhythm is irregular.

    Args:
        table (np.ndarray): a record's beat table (``rr`` in input samples, -1 unknown).
        beats (int): intervals in the window, this beat's included (>= 1).
        stat (str): ``median``, ``mean``, ``gated`` or ``gated_regular``.

    Returns:
        np.ndarray: (n_beats,) float64.
    """
    from numpy.lib.stride_tricks import sliding_window_view

    if stat not in RR_REFERENCES:
        raise ValueError(f"rr_reference must be one of {RR_REFERENCES}, got {stat!r}")
    if stat in ("gated", "gated_regular"):
        return gated_reference(table, beats, open_above=GATE_IRREGULAR if stat == "gated_regular" else None)
    rr = _known(table)
    padded = np.concatenate([np.full(beats - 1, np.nan), rr])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows (record start): unknown
        win = sliding_window_view(padded, beats)  # (n_beats, beats)
        return np.nanmedian(win, axis=1) if stat == "median" else np.nanmean(win, axis=1)


def rhythm_irregularity(intervals: np.ndarray) -> float:
    """How irregular a run of RR intervals is: median |successive difference| / median interval.

    Sinus rhythm changes little from beat to beat (a few percent of the cycle); atrial
    fibrillation is irregularly irregular (successive differences of 10-30% of the cycle). The
    median keeps one ectopic beat and its pause from making a regular rhythm look irregular.
    Prematurity, and so a supraventricular premature beat, is defined against a regular
    underlying rhythm.

    Args:
        intervals (np.ndarray): (n,) RR intervals in time order (any unit).

    Returns:
        float: the ratio; ``inf`` with fewer than 3 intervals (irregularity unknown).
    """
    x = np.asarray(intervals, dtype=np.float64)
    if x.size < 3:
        return float("inf")
    return float(np.median(np.abs(np.diff(x))) / np.median(x))


def running_irregularity(table: np.ndarray, beats: int) -> np.ndarray:
    """(n,) :func:`rhythm_irregularity` of the last ``beats`` known intervals, this beat's included.

    Unknown intervals are skipped (the window holds known ones only); ``inf`` while fewer than 3
    are known. Causal: a wearable could compute it.

    Args:
        table (np.ndarray): a record's beat table (``rr`` in input samples, -1 unknown).
        beats (int): known intervals in the window (>= 3).

    Returns:
        np.ndarray: (n_beats,) float64.
    """
    from numpy.lib.stride_tricks import sliding_window_view

    if int(beats) < 3:
        raise ValueError(f"running_irregularity needs beats >= 3 (two successive differences), got {beats}")
    rr = _known(table)
    ok = ~np.isnan(rr)
    known = rr[ok]
    win = sliding_window_view(np.concatenate([np.full(int(beats) - 1, np.nan), known]), int(beats))  # (m, beats)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: fewer than 3 known, set below
        irr = np.nanmedian(np.abs(np.diff(win, axis=1)), axis=1) / np.nanmedian(win, axis=1)  # (m,)
    irr[np.sum(~np.isnan(win), axis=1) < 3] = np.inf
    last = np.cumsum(ok) - 1  # (n,) index into ``known`` of the last known interval up to each beat
    return np.where(last >= 0, irr[np.maximum(last, 0)] if irr.size else np.inf, np.inf)


def gated_reference(table: np.ndarray, beats: int, open_above: Optional[float] = None) -> np.ndarray:
    """(n,) the median of the last ``beats`` intervals of the usual rhythm (input samples), NaN before any.

    Beat by beat, causal: a known interval enters the window when it is at least
    ``GATE_EARLY`` and at most ``GATE_PAUSE`` times the reference so far (the first known interval
    always enters); the reference of beat ``i`` is the window's median after beat ``i``'s
    interval was judged. ``GATE_SLOWER`` consecutive pauses replace the window with themselves
    (a slower rhythm, not a pause). Unknown intervals keep the reference as it is. With
    ``open_above``, every interval enters while the rhythm is irregular: the
    :func:`running_irregularity` of the last ``GATE_RHYTHM_BEATS`` known intervals, this one
    included, above ``open_above``.

    Args:
        table (np.ndarray): a record's beat table (``rr`` in input samples, -1 unknown).
        beats (int): accepted intervals in the window (>= 1).
        open_above (Optional[float]): the irregularity above which the gate is open (None: never).

    Returns:
        np.ndarray: (n_beats,) float64.
    """
    if int(beats) < 1:
        raise ValueError(f"gated_reference needs beats >= 1, got {beats}")
    rr = _known(table)
    irregular = (running_irregularity(table, GATE_RHYTHM_BEATS) > float(open_above) if open_above is not None
                 else np.zeros(rr.size, bool)).tolist()
    out = np.full(rr.size, np.nan)
    order: deque = deque()  # accepted intervals, oldest first
    ranked: list = []  # the same, sorted: the median without sorting every beat
    pauses: list = []  # the current streak of consecutive pauses
    ref = float("nan")

    def accept(x: float) -> None:
        order.append(x)
        insort(ranked, x)
        if len(order) > int(beats):
            del ranked[bisect_left(ranked, order.popleft())]

    for i, x in enumerate(rr.tolist()):
        if x == x:  # known (not NaN)
            if not order or irregular[i] or GATE_EARLY * ref <= x <= GATE_PAUSE * ref:
                accept(x)
                pauses.clear()
            elif x > GATE_PAUSE * ref:
                pauses.append(x)
                if len(pauses) >= GATE_SLOWER:  # a slower rhythm: it becomes the reference
                    order.clear()
                    ranked.clear()
                    for p in pauses:
                        accept(p)
                    pauses.clear()
            else:  # early: not the usual rhythm, and it ends a streak of pauses
                pauses.clear()
            k = len(ranked)
            ref = ranked[k // 2] if k % 2 else 0.5 * (ranked[k // 2 - 1] + ranked[k // 2])
        out[i] = ref
    return out


def long_reference(table: np.ndarray, beats: int, quantile: float = LONG_RR_QUANTILE) -> np.ndarray:
    """(n,) a quantile (default the upper quartile) of the last ``beats`` known intervals (input samples).

    Causal like :func:`running_reference` (this beat's interval included, NaN before any known
    one), computed ``_ROWS_PER_CHUNK`` beats at a time so a day-long record needs no
    ``(n_beats, beats)`` array.

    Args:
        table (np.ndarray): a record's beat table (``rr`` in input samples, -1 unknown).
        beats (int): intervals in the window (>= 1).
        quantile (float): 0..1.

    Returns:
        np.ndarray: (n_beats,) float64.
    """
    from numpy.lib.stride_tricks import sliding_window_view

    if int(beats) < 1 or not 0.0 <= float(quantile) <= 1.0:
        raise ValueError(f"long_reference needs beats >= 1 and a quantile in 0..1, got {beats}, {quantile}")
    rr = _known(table)
    win = sliding_window_view(np.concatenate([np.full(int(beats) - 1, np.nan), rr]), int(beats))  # (n, beats) view
    out = np.full(rr.size, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows (record start): unknown
        for lo in range(0, rr.size, _ROWS_PER_CHUNK):
            out[lo : lo + _ROWS_PER_CHUNK] = np.nanquantile(win[lo : lo + _ROWS_PER_CHUNK], float(quantile), axis=1)
    return out


def interval_tokens(values: np.ndarray, vocab: Vocabulary, reference: Optional[np.ndarray]) -> np.ndarray:
    """RR tokens of intervals: absolute (seconds) or relative to a running reference.

    Args:
        values (np.ndarray): (n,) intervals in **seconds** when ``reference`` is None, else in the
            reference's unit (input samples); NaN = unknown.
        vocab (Vocabulary): the shards' vocabulary (RR bins > 0).
        reference (Optional[np.ndarray]): (n,) running reference, or None for absolute tokens.

    Returns:
        np.ndarray: (n,) int64 token ids (the unknown-RR token for NaN).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        secs = values if reference is None else values / reference * NORMAL_RR_S
    return vocab.rr_base + rr_bin(secs, rr_edges(vocab.params))


def normalized_rr_tokens(table: np.ndarray, vocab: Vocabulary, beats: int, stat: str = "median") -> np.ndarray:
    """Each beat's RR relative to the patient's recent rhythm, as an RR token.

    ``ratio(i) = rr(i) / ref(i)``, ``ref`` the running median (or mean) of the last ``beats``
    intervals (:func:`running_reference`; causal, so a wearable could compute it), written as the
    RR token of ``ratio * NORMAL_RR_S``: the interval at a standard heart rate of 75 bpm. de
    Chazal 2004 normalizes by average RR intervals; an absolute RR identifies patients instead,
    since heart rates differ by patient.

    Args:
        table (np.ndarray): a record's beat table (``rr`` in input samples, -1 unknown).
        vocab (Vocabulary): the shards' vocabulary (RR bins > 0).
        beats (int): intervals in the running reference (>= 1).
        stat (str): ``median`` or ``mean``.

    Returns:
        np.ndarray: (n_beats,) int64 token ids (the unknown-RR token where rr is unknown).
    """
    return interval_tokens(_known(table), vocab, running_reference(table, beats, stat))


def long_rr_tokens(table: np.ndarray, vocab: Vocabulary, beats: int,
                   reference: Optional[np.ndarray] = None) -> np.ndarray:
    """Each beat's own interval against the upper quartile of the last ``beats`` (``long_rr``), as an RR token.

    ``rr(i) / long(i)`` (:func:`long_reference`), written as the RR token of ``ratio * NORMAL_RR_S``
    whether or not the prompt's other RR tokens are normalized: the ratio is what it is for.

    Args:
        table (np.ndarray): a record's beat table (``rr`` in input samples, -1 unknown).
        vocab (Vocabulary): the shards' vocabulary (RR bins > 0).
        beats (int): intervals in the long reference (>= 1).
        reference (Optional[np.ndarray]): ``long_reference(table, beats)`` when the caller has it.

    Returns:
        np.ndarray: (n_beats,) int64 token ids (the unknown-RR token where rr is unknown).
    """
    return interval_tokens(_known(table), vocab, long_reference(table, beats) if reference is None else reference)


def local_average_rr(table: np.ndarray, beats: int) -> np.ndarray:
    """(n,) mean known interval (input samples) of beats ``i - beats // 2 .. i + (beats - 1) // 2``.

    Args:
        table (np.ndarray): a record's beat table.
        beats (int): beats in the window, the target's included (>= 1).

    Returns:
        np.ndarray: (n_beats,) float64, NaN where the window holds no known interval.
    """
    rr = _known(table)
    n = rr.size
    ok = ~np.isnan(rr)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, rr, 0.0))])
    ccnt = np.concatenate([[0], np.cumsum(ok)])
    i = np.arange(n)
    lo = np.clip(i - beats // 2, 0, n)
    hi = np.clip(i + (beats - 1) // 2 + 1, 0, n)
    cnt = ccnt[hi] - ccnt[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, (csum[hi] - csum[lo]) / np.maximum(cnt, 1), np.nan)


def window_average_rr(table: np.ndarray, seconds: float, fs: float) -> np.ndarray:
    """(n,) mean known interval (input samples) of the beats within ``seconds / 2`` of each beat.

    Args:
        table (np.ndarray): a record's beat table (``sample``, ``rr`` in input samples).
        seconds (float): window length (s), centred on the beat.
        fs (float): the record's sampling rate (Hz).

    Returns:
        np.ndarray: (n_beats,) float64, NaN where the window holds no known interval.
    """
    rr = _known(table)
    t = table["sample"].astype(np.float64)
    half = float(seconds) / 2.0 * float(fs)
    ok = ~np.isnan(rr)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, rr, 0.0))])
    ccnt = np.concatenate([[0], np.cumsum(ok)])
    lo = np.searchsorted(t, t - half, side="left")
    hi = np.searchsorted(t, t + half, side="right")
    cnt = ccnt[hi] - ccnt[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, (csum[hi] - csum[lo]) / np.maximum(cnt, 1), np.nan)
