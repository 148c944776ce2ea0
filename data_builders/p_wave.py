"""Atrial activity before the R peak: do the beats before a target share one P wave?

A supraventricular premature beat interrupts a rhythm whose beats each follow the same P wave (sinus
rhythm, an atrial focus); the N beats that come early in the training patients mostly sit in rhythms
with no regular P wave at all (atrial fibrillation or flutter: svdb/804, svdb/893, mitdb/203). The RR
tokens cannot tell the two apart (an irregular context is both), and the target beat's own P wave
did not either (docs/hlm-experiments.md, 2026-12-06: its correlation with the patient's usual P wave
scored a pooled AUC of 0.445 for S against N among early beats). What did, on the 61 training
patients' annotations (same entry's follow-up, no model, DS2 not read): how alike the **earlier**
beats' P-wave segments are to each other, pooled AUC 0.757 for S against N among the 9,200 early
beats (within a patient, median 0.60 over the 16 patients with both).

:func:`p_wave_regularity` computes that from the beat windows alone (the shards' samples, never a
label, never the target beat's own samples): for beat ``j``, the segments 0.25-0.06 s before the R
peaks of beats ``j - K .. j - 1`` (each with its mean removed), their sample-wise median, and the
median over the ``K`` segments of each one's correlation with that median. Near 1: the same P wave
before every beat; near 0 or below: fibrillatory waves or noise. :func:`p_wave_tokens` writes it as
one of the prompt's RR tokens (its position, last before ``<beat?>``, says what it is), so no
vocabulary entry is added and pretrained models stay usable.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

# The P-wave segment, seconds before the R peak: a PR interval is 0.12-0.20 s and a P wave lasts up
# to ~0.11 s, so 0.25 .. 0.06 s covers the P wave and stops before the Q wave.
P_SEGMENT_S = (0.25, 0.06)
_ROWS_PER_CHUNK = 4096  # beats whose (K, L) context windows are held at once: bounded memory


def p_segments(waves_mv: np.ndarray, *, pre: int, fs: float) -> np.ndarray:
    """(n, L) each beat's P-wave segment (:data:`P_SEGMENT_S` before R) with its mean removed.

    Args:
        waves_mv (np.ndarray): (n, W) beat windows in mV, the R peak at sample ``pre``.
        pre (int): window samples before the R peak.
        fs (float): the windows' sampling rate (Hz).

    Returns:
        np.ndarray: (n, L) float64, L = round(0.25 fs) - round(0.06 fs) samples.

    Raises:
        ValueError: the window does not reach 0.25 s before its R peak.
    """
    lo, hi = int(round(P_SEGMENT_S[0] * fs)), int(round(P_SEGMENT_S[1] * fs))
    if lo > pre or hi >= lo:
        raise ValueError(f"p_wave_beats needs {P_SEGMENT_S[0]} s of window before the R peak: {pre} samples at "
                         f"{fs:g} Hz is {pre / fs:.3f} s")
    seg = np.asarray(waves_mv, np.float64)[:, pre - lo: pre - hi]
    return seg - seg.mean(axis=1, keepdims=True)


def p_wave_regularity(waves_mv: np.ndarray, *, pre: int, fs: float, beats: int) -> np.ndarray:
    """(n,) how alike the P-wave segments of the ``beats`` beats before each beat are.

    Beat ``j``'s value is the median over beats ``j - beats .. j - 1`` of the correlation of each
    one's P-wave segment (:func:`p_segments`) with the sample-wise median of those segments. Causal
    and label-free: the beat's own samples and every later beat are not read. NaN for the first
    ``beats`` beats and where every segment of the context is flat.

    Args:
        waves_mv (np.ndarray): (n, W) beat windows in mV, the R peak at sample ``pre``.
        pre (int): window samples before the R peak.
        fs (float): the windows' sampling rate (Hz).
        beats (int): earlier beats compared (>= 3: a median of two is their mean).

    Returns:
        np.ndarray: (n,) float64 in [-1, 1] or NaN.
    """
    if int(beats) < 3:
        raise ValueError(f"p_wave_beats compares at least 3 earlier beats, got {beats}")
    k = int(beats)
    seg = p_segments(waves_mv, pre=pre, fs=fs)  # (n, L)
    n = seg.shape[0]
    out = np.full(n, np.nan)
    if n <= k:
        return out
    norm = np.linalg.norm(seg, axis=1)  # (n,)
    windows = np.lib.stride_tricks.sliding_window_view(seg, k, axis=0)  # (n - k + 1, L, k): beats w .. w+k-1
    wnorm = np.lib.stride_tricks.sliding_window_view(norm, k)  # (n - k + 1, k)
    for s in range(0, n - k, _ROWS_PER_CHUNK):
        e = min(n - k, s + _ROWS_PER_CHUNK)  # window w serves beat w + k (its k earlier beats)
        ctx = windows[s:e]  # (m, L, k)
        med = np.median(ctx, axis=2)  # (m, L) the context's usual P-wave segment
        med = med - med.mean(axis=1, keepdims=True)
        dot = np.einsum("mlk,ml->mk", ctx, med)  # (m, k)
        with np.errstate(invalid="ignore", divide="ignore"):
            corr = dot / (wnorm[s:e] * np.linalg.norm(med, axis=1)[:, None])  # (m, k), NaN for a flat segment
        corr[~np.isfinite(corr)] = np.nan
        have = np.isfinite(corr).any(axis=1)
        vals = np.full(e - s, np.nan)
        vals[have] = np.nanmedian(corr[have], axis=1)
        out[s + k: e + k] = vals
    return out


def p_wave_tokens(values: np.ndarray, *, rr_base: int, rr_bins: int, unknown: Optional[int] = None) -> np.ndarray:
    """(n,) RR token ids standing for ``values`` in [-1, 1]: bin ``floor((v + 1) / 2 * rr_bins)``.

    Args:
        values (np.ndarray): (n,) :func:`p_wave_regularity` values (NaN: unknown).
        rr_base (int): id of the first RR token.
        rr_bins (int): RR bins of the vocabulary (the unknown token is ``rr_base + rr_bins``).
        unknown (Optional[int]): the token for NaN (default ``rr_base + rr_bins``).

    Returns:
        np.ndarray: (n,) int64 token ids.
    """
    v = np.asarray(values, np.float64)
    known = np.isfinite(v)
    b = np.clip(np.floor((np.where(known, v, 0.0) + 1.0) / 2.0 * rr_bins), 0, rr_bins - 1).astype(np.int64)
    return np.where(known, rr_base + b, rr_base + rr_bins if unknown is None else int(unknown)).astype(np.int64)


__all__ = ["P_SEGMENT_S", "p_segments", "p_wave_regularity", "p_wave_tokens"]
