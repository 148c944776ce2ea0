"""Slow, plain reference tokenizer: one beat at a time, one canonical sample at a time.

It follows the definitions literally (Python integers for positions, the filter sum of
each canonical sample evaluated on its own) so the vectorised :mod:`core` path can be
checked against it exactly (``np.array_equal`` on tokens). Only for tests: it is about a
thousand times slower.
"""

from __future__ import annotations

import math

import numpy as np

from hlmtune.ecg_tokenizer.core import BEAT_DTYPE, TokenizedRecord, check_length, get_vocab
from hlmtune.ecg_tokenizer.labels import BEAT_SYMBOLS, symbol_to_class
from hlmtune.ecg_tokenizer.records import EcgRecord
from hlmtune.ecg_tokenizer.resample import SCALE, get_resampler
from hlmtune.ecg_tokenizer.vocab import (
    BOS_ID,
    EOS_ID,
    SEP_ID,
    TokenizerParams,
    quantize,
    quantizer_edges,
    rr_bin,
    rr_edges,
)


def tokenize_record_reference(rec: EcgRecord, params: TokenizerParams) -> TokenizedRecord:
    """Tokenize one record beat by beat (reference for :func:`core.tokenize_record`).

    Args:
        rec (EcgRecord): the record.
        params (TokenizerParams): parameters.

    Returns:
        TokenizedRecord: same contract as the fast path.
    """
    check_length(rec, params)
    vocab = get_vocab(params)
    q_edges, r_edges = quantizer_edges(params), rr_edges(params)
    rs = get_resampler(rec.fs, params.target_rate)
    sym2cls = symbol_to_class(params.label_mode)
    unlabeled = len(vocab.classes) - 1
    nb, w, pre, n_in = int(params.rr_bins), int(params.window), params.pre, rec.n_samples
    tokens = [BOS_ID]
    rows, dropped, lead2 = [], list(rec.dropped), []
    prev = None
    for j in range(rec.beat_samples.size):
        r = int(rec.beat_samples[j])
        sym = int(rec.beat_symbols[j])
        label = sym2cls[BEAT_SYMBOLS[sym]] if sym >= 0 else unlabeled
        rr = r - prev if prev is not None else -1
        prev = r
        rb = int(rr_bin(np.array([rr / rec.fs if rr >= 0 else math.nan]), r_edges)[0])
        start = len(tokens)
        if params.scheme == "annotation":
            tokens.append(vocab.label_base + (label * (nb + 1) + rb if nb else label))
        else:
            # Canonical sample nearest the R peak: round(r * up / down), halves up.
            m_r = (2 * r * rs.up + rs.down) // (2 * rs.down)
            m0 = m_r - pre
            first = -((rs.center - m0 * rs.down) // rs.up)  # ceil((m0 * down - D) / up)
            last = ((m0 + w - 1) * rs.down + rs.center) // rs.up
            if first < 0:
                dropped.append({"sample": r, "reason": "window starts before the record"})
                continue
            if last > n_in - 1:
                dropped.append({"sample": r, "reason": "window ends after the record"})
                continue
            window = np.array([float(rs.at(rec.signal, m)) for m in range(m0, m0 + w)])
            baseline = np.median(window)
            mv = (window - baseline) / (SCALE * rec.gain_per_mv)
            levels = quantize(mv, q_edges)
            if rec.signal2 is not None:  # the second lead, the same window, its own gain
                window2 = np.array([float(rs.at(rec.signal2, m)) for m in range(m0, m0 + w)])
                mv2 = (window2 - np.median(window2)) / (SCALE * rec.gain2_per_mv)
                lead2.append([vocab.sample_base + int(q) for q in quantize(mv2, q_edges)])
            tokens.append(SEP_ID)  # the label is never written into a samples stream
            if nb:
                tokens.append(vocab.rr_base + rb)
            tokens += [vocab.sample_base + int(q) for q in levels]
        rows.append((r, sym, label, rr, rb, int(rec.beat_rhythms[j]), start))
    tokens.append(EOS_ID)
    return TokenizedRecord(
        rec.name,
        np.array(tokens, dtype=vocab.dtype),
        np.array(rows, dtype=BEAT_DTYPE),
        dropped,
        lead2=(np.array(lead2, dtype=vocab.dtype).reshape(len(lead2), w)
               if rec.signal2 is not None and params.scheme != "annotation" else None),
    )
