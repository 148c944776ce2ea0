"""Vectorised reader for WFDB MIT-format annotation files (``.atr`` and friends).

``wfdb.rdann`` walks the file two bytes at a time in Python (``proc_ann_bytes``), which
costs about 1.5 s for the 48 MIT-BIH annotation files, more than reading the signals. This
reader does the same walk with numpy: it returns exactly the ``sample``, ``symbol``,
``aux_note``, ``subtype``, ``chan`` and ``num`` that ``wfdb.rdann(record, ext,
sampto=sampto)`` returns (checked on every MIT-BIH record in the tests), and ``None`` for
any construct it leaves to ``wfdb.rdann`` (the caller falls back to it), so the result
never differs from wfdb's.

Format (WFDB "annotation files (5)", MIT format; checked against wfdb 4.3
``wfdb/io/annotation.py``, whose behaviour is the reference): a sequence of 16-bit
little-endian words, type code ``A = word >> 10``, ``I = word & 0x3FF``.

* ``A`` in 1..49: an annotation of type ``A`` at time (previous time + ``I``). wfdb also
  accepts ``A = 0`` (and ``A`` 50..58) at this place: ``A = 0`` annotations advance the time
  and are then removed; undefined codes become NaN symbols (left to wfdb, see below).
* ``A = 59`` SKIP: the next two words are a signed 32-bit interval, high word first
  (PDP-11 order), added to the time of the next annotation.
* ``A = 60`` NUM, ``61`` SUB, ``62`` CHN: the low *byte* of the word (wfdb ignores the two
  high bits of ``I``) is the preceding annotation's ``num`` (signed char), ``subtype``
  (signed char) or ``chan`` (unsigned char). ``num`` and ``chan`` persist to the following
  annotations until changed (default 0); ``subtype`` does not (default 0).
* ``A = 63`` AUX: low byte = string length ``n``, then ``ceil(n / 2)`` words of bytes (one
  byte per character, ``chr`` of each, i.e. latin-1; the pad byte of odd lengths dropped);
  it belongs to the preceding annotation (default ``""``).
* The last word of the file is the end marker (``0``); wfdb never reads it.

``sampto``: like wfdb, annotations are kept up to (not including) the first one whose time
exceeds ``sampto`` (``sample <= sampto`` is kept; ``sampto`` 0 or None means the whole file).

Left to ``wfdb.rdann`` (``None`` is returned):

* a NOTE (code 22) at sample 0: wfdb reads these as file definitions (sampling frequency,
  custom annotation labels, which change the code -> symbol map) and removes them;
* codes without a symbol in wfdb's table (15, 17, 42..58: NaN symbols in wfdb);
* an odd byte count, an empty file, a last word that is not the end marker (a truncated
  file: wfdb silently ignores its last word), a SKIP or AUX payload running past the end,
  a SKIP not followed by an annotation, a NUM/SUB/CHN/AUX word with no annotation before it
  (wfdb would read it as an annotation of type 60..63), and two words of the same field for
  one annotation (wfdb's field lists go out of step).

So a damaged file never gives a silently different answer here: wfdb decides, either
reading it its own way or raising (which ``load_record`` turns into a ``RecordError``
naming the file). The reader itself raises only ``OSError`` when the file cannot be read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple, Union

import numpy as np

# Pseudo-annotation codes (WFDB ecgcodes.h).
SKIP, NUM, SUB, CHN, AUX = 59, 60, 61, 62, 63
NOTE = 22  # a NOTE at sample 0 holds file definitions (wfdb: get_special_inds)


@dataclass
class MitAnnotations:
    """The fields of an annotation file, as ``wfdb.rdann`` returns them.

    Attributes:
        sample (np.ndarray): (n,) int64 annotation times (samples from the record start).
        symbol (List[str]): n annotation symbols (wfdb's ``ann_label_table``).
        aux_note (List[str]): n auxiliary strings (``""`` when absent).
        subtype (np.ndarray): (n,) int64.
        chan (np.ndarray): (n,) int64.
        num (np.ndarray): (n,) int64.
        label_store (np.ndarray): (n,) int64 type codes (wfdb returns None here by default).
    """

    sample: np.ndarray
    symbol: List[str]
    aux_note: List[str] = field(default_factory=list)
    subtype: Optional[np.ndarray] = None
    chan: Optional[np.ndarray] = None
    num: Optional[np.ndarray] = None
    label_store: Optional[np.ndarray] = None


@functools.lru_cache(maxsize=1)
def _symbol_table() -> Tuple[Optional[str], ...]:
    """Symbol of each code 0..63 from wfdb's own table (None where wfdb has none)."""
    from wfdb.io.annotation import ann_label_table

    table: List[Optional[str]] = [None] * 64
    for code, sym in zip(ann_label_table["label_store"].tolist(), ann_label_table["symbol"].tolist()):
        if 0 <= int(code) < 64 and isinstance(sym, str):
            table[int(code)] = sym
    return tuple(table)


def _forward_fill(n: int, ann_ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(n,) int64: the value set at or before each annotation (0 before the first)."""
    out = np.zeros(n, dtype=np.int64)
    if ann_ids.size == 0:
        return out
    last = np.full(n, -1, dtype=np.int64)
    last[ann_ids] = np.arange(ann_ids.size)
    last = np.maximum.accumulate(last)  # index into values of the latest setting
    return np.where(last >= 0, values.astype(np.int64)[np.maximum(last, 0)], 0)


def parse_mit_annotations(data: bytes, *, sampto: Optional[int] = None) -> Optional[MitAnnotations]:
    """Decode the bytes of a MIT-format annotation file.

    Args:
        data (bytes): the whole file.
        sampto (Optional[int]): keep annotations up to the first one after this sample
            (wfdb's ``rdann(sampto=...)``); None or 0 keeps all.

    Returns:
        Optional[MitAnnotations]: the annotations, or None when the file holds a construct
        left to ``wfdb.rdann`` (see the module docstring).
    """
    if len(data) < 2 or len(data) % 2:
        return None
    words = np.frombuffer(data, dtype="<u2")
    if words[-1] != 0:  # no end marker: truncated (wfdb would drop the last word silently)
        return None
    body = words[:-1]  # the words wfdb walks, (nw,)
    code = (body >> 10).astype(np.int64)  # A, (nw,)
    low = (body & 0xFF).astype(np.int64)  # low byte: NUM/SUB/CHN value, AUX length, (nw,)
    header = _header_words(code, low)
    if header is None:
        return None
    hpos = np.flatnonzero(header)  # header word positions, in file order, (nh,)
    hcode = code[hpos]
    if not _well_formed(hcode):
        return None
    ann_count = np.cumsum(hcode < SKIP)  # annotations up to and including each header
    n_ann = int(ann_count[-1]) if ann_count.size else 0
    ann_pos = hpos[hcode < SKIP]  # (n_ann,)
    labels = code[ann_pos]
    sample = _sample_times(body, hpos, hcode, ann_count, ann_pos)
    fields = _annotation_fields(data, low, hpos, hcode, ann_count, n_ann)
    if fields is None:
        return None
    subtype, chan, num, aux_note = fields
    if sampto:  # wfdb stops at the first annotation after sampto
        over = np.flatnonzero(sample > sampto)
        if over.size:
            cut = int(over[0])
            sample, labels, subtype, chan, num = (x[:cut] for x in (sample, labels, subtype, chan, num))
            aux_note = aux_note[:cut]
    if np.any((sample == 0) & (labels == NOTE)):
        return None  # file definitions (fs, custom labels): wfdb's job
    real = labels != 0  # code 0 words advance the time but are not annotations
    if not real.all():
        keep = np.flatnonzero(real)
        sample, labels, subtype, chan, num = (x[keep] for x in (sample, labels, subtype, chan, num))
        aux_note = [aux_note[i] for i in keep.tolist()]
    table = _symbol_table()
    symbol = [table[c] for c in labels.tolist()]
    if None in symbol:
        return None  # undefined code: wfdb gives NaN
    return MitAnnotations(
        sample=sample.astype(np.int64), symbol=symbol, aux_note=aux_note,
        subtype=subtype, chan=chan, num=num, label_store=labels.astype(np.int64),
    )


def _header_words(code: np.ndarray, low: np.ndarray) -> Optional[np.ndarray]:
    """Which words are headers (annotation, SKIP, NUM, SUB, CHN, AUX), not SKIP/AUX payload.

    Walks only the words whose code is >= 59 (a few per thousand), skipping those that lie
    inside a payload; a payload word with a smaller code is masked out too. None when a
    payload runs into the end marker or past the file end.
    """
    nw = int(code.size)
    header = np.ones(nw, dtype=bool)
    special = np.flatnonzero(code >= SKIP)
    next_free = 0
    for p, a, n in zip(special.tolist(), code[special].tolist(), low[special].tolist()):
        if p < next_free:  # inside the previous payload
            continue
        if a == SKIP:
            end = p + 3
        elif a == AUX:
            end = p + 1 + (n + 1) // 2
        else:
            continue
        if end > nw:
            return None
        header[p + 1 : end] = False
        next_free = end
    return header


def _well_formed(hcode: np.ndarray) -> bool:
    """A field word follows an annotation or another field word; a SKIP is followed by an annotation.

    (wfdb reads a field word right after a SKIP, or first in the file, as an annotation of
    type 60..63: a construct left to it.)
    """
    if not hcode.size:
        return True
    prev_code = np.concatenate(([SKIP], hcode[:-1]))
    return not (np.any((hcode > SKIP) & (prev_code == SKIP)) or hcode[-1] == SKIP)


def _sample_times(body: np.ndarray, hpos: np.ndarray, hcode: np.ndarray, ann_count: np.ndarray,
                  ann_pos: np.ndarray) -> np.ndarray:
    """Each annotation's sample: the running sum of its I field and the SKIP intervals before it."""
    delta = (body[ann_pos] & 0x3FF).astype(np.int64)
    skip_h = hcode == SKIP
    if skip_h.any():
        sp = hpos[skip_h]
        # high word first, then low word; signed 32-bit (wfdb: two's complement long)
        interval = ((body[sp + 1].astype(np.uint32) << 16) | body[sp + 2].astype(np.uint32)).view(np.int32)
        np.add.at(delta, ann_count[skip_h], interval.astype(np.int64))  # the next annotation
    return np.cumsum(delta)


def _annotation_fields(data: bytes, low: np.ndarray, hpos: np.ndarray, hcode: np.ndarray, ann_count: np.ndarray,
                       n_ann: int) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray, List[str]]]:
    """(subtype, chan, num, aux_note) per annotation: each field word belongs to the annotation
    before it; CHN and NUM persist to the next annotations, as in wfdb. None when one
    annotation has two words of one field."""
    fields = {}
    for fcode in (NUM, SUB, CHN, AUX):
        sel = hcode == fcode
        pos = hpos[sel]
        ids = ann_count[sel] - 1
        if ids.size > 1 and np.any(np.diff(ids) == 0):
            return None
        fields[fcode] = (pos, ids)
    subtype = np.zeros(n_ann, dtype=np.int64)
    pos, ids = fields[SUB]
    subtype[ids] = low[pos].astype(np.uint8).view(np.int8)  # signed char
    chan = _forward_fill(n_ann, fields[CHN][1], low[fields[CHN][0]])  # unsigned char, persists
    pos, ids = fields[NUM]
    num = _forward_fill(n_ann, ids, low[pos].astype(np.uint8).view(np.int8))  # signed, persists
    aux_note = [""] * n_ann
    pos, ids = fields[AUX]
    for p, i, n in zip(pos.tolist(), ids.tolist(), low[pos].tolist()):
        start = 2 * p + 2
        aux_note[i] = data[start : start + n].decode("latin-1")  # wfdb: chr() of each byte
    return subtype, chan, num, aux_note


def read_mit_annotations(path: Union[str, Path], *, sampto: Optional[int] = None) -> Optional[MitAnnotations]:
    """Read a MIT-format annotation file, or None when ``wfdb.rdann`` must do it.

    Args:
        path (Union[str, Path]): the annotation file (e.g. ``mitdb/100.atr``).
        sampto (Optional[int]): as ``wfdb.rdann(sampto=...)``.

    Returns:
        Optional[MitAnnotations]: equal to ``wfdb.rdann(record, ext, sampto=sampto)``
        in ``sample``, ``symbol``, ``aux_note``, ``subtype``, ``chan`` and ``num``; None
        for the constructs listed in the module docstring.

    Raises:
        OSError: the file cannot be read.
    """
    return parse_mit_annotations(Path(path).read_bytes(), sampto=sampto)
