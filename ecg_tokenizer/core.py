"""Fast tokenizer: one record at a time, every beat at once (numpy, no Python loop per beat).

Scheme ``samples`` per record::

    canonical = exact integer resampling of the whole lead to target_rate   (resample.py)
    windows   = canonical[m_r - pre : m_r - pre + window] for every beat    (fancy indexing)
    mV        = (windows - median(windows, per beat)) / (2**20 * gain)       (baseline removal)
    levels    = quantize(mV)                                                (vocab.py)

where ``m_r`` is the canonical sample nearest the R peak. Beats whose window needs input
samples outside the record are dropped and reported. The token stream of a record is
``<bos> beat ... beat <eos>``; a ``samples`` beat is ``<sep> [RR] q... q``: signal-derived
tokens only, its label lives in the beat table (``beats.npy``) so a model reading the stream
never sees a cardiologist's label; an ``annotation`` beat is one token (label, or label x RR
bin), the symbol stream of rhythm models, never an input for beat classification.
:mod:`hlmtune.ecg_tokenizer.reference` computes the same thing one beat at a time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from hlmtune.ecg_tokenizer.labels import BEAT_SYMBOLS, symbol_to_class
from hlmtune.ecg_tokenizer.records import EcgRecord, RecordError
from hlmtune.ecg_tokenizer.resample import SCALE, get_resampler
from hlmtune.ecg_tokenizer.vocab import (
    BOS_ID,
    EOS_ID,
    SEP_ID,
    FastQuantizer,
    TokenizerParams,
    Vocabulary,
    quantizer_edges,
    rr_bin,
    rr_edges,
)

# One row per kept beat, stored as ``<record>.beats.npy`` next to the tokens.
BEAT_DTYPE = np.dtype(
    [
        ("sample", "<i8"),  # R peak, input sample index
        ("symbol", "<i2"),  # index into labels.BEAT_SYMBOLS, -1 unlabeled (detector)
        ("label", "<i2"),  # label class id (labels.label_classes(label_mode))
        ("rr", "<i8"),  # samples since the previous beat, -1 for the first beat
        ("rr_bin", "<i2"),  # RR bin, rr_bins = unknown
        ("rhythm", "<i2"),  # index into the record's rhythm list, -1 unknown
        ("token_start", "<i8"),  # offset of the beat's first token in the token array
    ]
)


@dataclass
class TokenizedRecord:
    """Tokens of one record and what happened to its beats.

    Attributes:
        name (str): record name.
        tokens (np.ndarray): (n_tokens,) token ids (uint16 or uint32).
        beats (np.ndarray): (n_kept,) BEAT_DTYPE rows.
        dropped (List[Dict]): beats not tokenized: ``{"sample", "reason"}``.
        lead2 (Optional[np.ndarray]): (n_kept, window) sample token ids of the second lead's
            window around each kept beat (same positions, baseline removal and quantizer as the
            stream's ``q`` tokens), when the record was read with ``second_lead``; else None.
    """

    name: str
    tokens: np.ndarray
    beats: np.ndarray
    dropped: List[Dict] = field(default_factory=list)
    lead2: Optional[np.ndarray] = None


@functools.lru_cache(maxsize=16)
def get_vocab(params: TokenizerParams) -> Vocabulary:
    """Cached :class:`Vocabulary` of a parameter set."""
    return Vocabulary(params)


@functools.lru_cache(maxsize=16)
def _edges(params: TokenizerParams):
    return quantizer_edges(params), rr_edges(params)


@functools.lru_cache(maxsize=16)
def _fast_quantizer(params: TokenizerParams) -> FastQuantizer:
    return FastQuantizer(_edges(params)[0])


@functools.lru_cache(maxsize=4)
def _label_lut(label_mode: str) -> np.ndarray:
    m = symbol_to_class(label_mode)
    return np.array([m[s] for s in BEAT_SYMBOLS], dtype=np.int16)


def beat_labels(symbols: np.ndarray, params: TokenizerParams) -> np.ndarray:
    """Class id per beat (unlabeled beats get the last class).

    Args:
        symbols (np.ndarray): int16 symbol indices, -1 unlabeled.
        params (TokenizerParams): parameters (label mode).

    Returns:
        np.ndarray: int16 class ids.
    """
    lut = _label_lut(params.label_mode)
    unl = len(get_vocab(params).classes) - 1
    s = np.asarray(symbols, dtype=np.int64)
    return np.where(s >= 0, lut[np.maximum(s, 0)], unl).astype(np.int16)


def window_plan(rec: EcgRecord, params: TokenizerParams):
    """Canonical window start of each beat and whether its input support fits the record.

    Args:
        rec (EcgRecord): the record.
        params (TokenizerParams): parameters.

    Returns:
        Tuple[np.ndarray, np.ndarray, np.ndarray]: (m0, keep, reason) - first canonical
        index of each beat's window, a bool mask of beats inside the record, and a code per
        beat (0 ok, 1 window starts before the record, 2 window ends after it).
    """
    rs = get_resampler(rec.fs, params.target_rate)
    beats = rec.beat_samples
    # Nearest canonical sample to the R peak, in exact integers: round(r * up / down).
    m_r = (2 * beats * rs.up + rs.down) // (2 * rs.down)
    m0 = m_r - params.pre
    lo, _ = rs.support(m0)
    _, hi = rs.support(m0 + params.window - 1)
    reason = np.where(lo < 0, 1, np.where(hi > rec.n_samples - 1, 2, 0))
    return m0, reason == 0, reason


def check_length(rec: EcgRecord, params: TokenizerParams) -> None:
    """Raise :class:`RecordError` when the record cannot hold one window."""
    if params.scheme != "samples":
        return
    rs = get_resampler(rec.fs, params.target_rate)
    lo, _ = rs.support(np.array([0]))
    _, hi = rs.support(np.array([params.window - 1]))
    need = int(hi[0] - lo[0] + 1)
    if rec.n_samples < need:
        raise RecordError(
            rec.name,
            f"record is shorter than the window: {rec.n_samples} samples ({rec.n_samples / rec.fs:.3f} s at "
            f"{rec.fs:g} Hz), a {params.window}-sample window at {params.target_rate:g} Hz needs {need} input samples",
        )


_DROP_REASONS = {1: "window starts before the record", 2: "window ends after the record"}


def rr_info(rec: EcgRecord, params: TokenizerParams):
    """RR interval (samples, -1 unknown) and RR bin of every beat (before any drop)."""
    beats = rec.beat_samples
    rr = np.empty(beats.size, dtype=np.int64)
    rr[:1] = -1
    rr[1:] = np.diff(beats)
    rr_s = np.where(rr >= 0, rr / rec.fs, np.nan)
    return rr, rr_bin(rr_s, _edges(params)[1])


def tokenize_record(rec: EcgRecord, params: TokenizerParams) -> TokenizedRecord:
    """Tokenize one record, vectorised over its beats.

    Args:
        rec (EcgRecord): from :func:`hlmtune.ecg_tokenizer.records.load_record`.
        params (TokenizerParams): parameters.

    Returns:
        TokenizedRecord: tokens, beat table, dropped beats.

    Raises:
        RecordError: the record is shorter than one window.
    """
    check_length(rec, params)
    vocab = get_vocab(params)
    lead2 = None
    n = rec.beat_samples.size
    labels = beat_labels(rec.beat_symbols, params)
    rr, rrb = rr_info(rec, params)
    nb = int(params.rr_bins)

    if params.scheme == "annotation":
        keep = np.ones(n, dtype=bool)
        reason = np.zeros(n, dtype=np.int64)
        body = np.empty((n, 1), dtype=vocab.dtype)
        if nb:
            body[:, 0] = vocab.label_base + labels.astype(np.int64) * (nb + 1) + rrb
        else:
            body[:, 0] = vocab.label_base + labels.astype(np.int64)
    else:
        m0, keep, reason = window_plan(rec, params)
        k = int(keep.sum())
        w = int(params.window)
        lev = _window_levels(rec.signal, rec.gain_per_mv, rec.fs, m0[keep], params)  # (k, W)
        if rec.signal2 is not None:  # the second lead at the same positions: (k, W) sample tokens
            lead2 = (_window_levels(rec.signal2, rec.gain2_per_mv, rec.fs, m0[keep], params)
                     + vocab.sample_base).astype(vocab.dtype)
        h = 2 if nb else 1  # <sep> [rr]: no label token, the label stays in the beat table
        body = np.empty((k, h + w), dtype=vocab.dtype)  # (k, tokens per beat)
        body[:, 0] = SEP_ID
        if nb:
            body[:, 1] = vocab.rr_base + rrb[keep]
        lev += vocab.sample_base
        body[:, h:] = lev

    per_beat = body.shape[1]
    tokens = np.empty(body.size + 2, dtype=vocab.dtype)
    tokens[0], tokens[-1] = BOS_ID, EOS_ID
    tokens[1:-1] = body.reshape(-1)
    kept = int(keep.sum())
    beats = np.empty(kept, dtype=BEAT_DTYPE)
    beats["sample"] = rec.beat_samples[keep]
    beats["symbol"] = rec.beat_symbols[keep]
    beats["label"] = labels[keep]
    beats["rr"] = rr[keep]
    beats["rr_bin"] = rrb[keep]
    beats["rhythm"] = rec.beat_rhythms[keep]
    beats["token_start"] = 1 + per_beat * np.arange(kept, dtype=np.int64)
    dropped = list(rec.dropped) + [
        {"sample": int(s), "reason": _DROP_REASONS[int(r)]}
        for s, r in zip(rec.beat_samples[~keep], reason[~keep])
    ]
    return TokenizedRecord(rec.name, tokens, beats, dropped, lead2=lead2)


def _window_levels(signal: np.ndarray, gain_per_mv: float, fs: float, m0: np.ndarray, params: TokenizerParams) -> np.ndarray:
    """(k, W) quantizer levels of one lead's window starting at canonical sample ``m0`` (k,) of each beat."""
    w = int(params.window)
    canon = get_resampler(fs, params.target_rate).whole(signal)  # exact integers as float64
    win = canon[m0[:, None] + np.arange(w)]  # (k, W)
    # (k, 1) per-beat baseline = np.median(win, axis=1): the values are exact integers,
    # so the mean of the two middle order statistics is exact and equal to np.median's.
    mid = w // 2
    part = np.partition(win, (mid - 1, mid) if w % 2 == 0 else (mid,), axis=1)
    base = (part[:, mid - 1 : mid] + part[:, mid : mid + 1]) / 2 if w % 2 == 0 else part[:, mid : mid + 1]
    win -= base
    mv = np.divide(win, SCALE * gain_per_mv, out=win)  # (k, W) millivolts
    return _fast_quantizer(params)(mv)  # (k, W), == vocab.quantize(mv, edges)
