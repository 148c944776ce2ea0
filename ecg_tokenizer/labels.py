"""Beat and rhythm label tables (WFDB annotation symbols, AAMI EC57 classes).

Sources: the WFDB annotation code table (``wfdb.io.annotation.ann_label_table``, PhysioNet
"Annotations" docs) and the AAMI EC57 grouping used by de Chazal et al. (2004):
N <- N L R e j; S <- A a J S; V <- V E; F <- F; Q <- / f Q. The rarer WFDB beat codes absent
from MIT-BIH follow the usual extension: B (bundle branch block) -> N, n (supraventricular
escape) -> S, r (R-on-T PVC) -> V, ? (beat not classified) -> Q.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

# Every WFDB symbol that marks a beat (QRS complex), in WFDB code order. Fixed, so the
# vocabulary never depends on which records were tokenized.
BEAT_SYMBOLS: Tuple[str, ...] = (
    "N", "L", "R", "a", "V", "F", "J", "A", "S", "E", "j", "/", "Q", "B", "e", "n", "f", "r", "?",
)

# WFDB symbols that are annotations but not beats (dropped from the token stream).
NON_BEAT_SYMBOLS: Tuple[str, ...] = (
    "~", "|", "s", "T", "*", "D", '"', "=", "p", "^", "t", "+", "u", "!", "[", "]", "@", "x",
    "(", ")",
)

AAMI_CLASSES: Tuple[str, ...] = ("N", "S", "V", "F", "Q")

AAMI_MAP: Dict[str, str] = {
    **{s: "N" for s in ("N", "L", "R", "e", "j", "B")},
    **{s: "S" for s in ("A", "a", "J", "S", "n")},
    **{s: "V" for s in ("V", "E", "r")},
    "F": "F",
    **{s: "Q" for s in ("/", "f", "Q", "?")},
}

# Rhythm labels of the MIT-BIH Arrhythmia Database (aux_note of '+' annotations). They get
# vocabulary tokens so prompts can name a rhythm (e.g. atrial fibrillation detection);
# anything else maps to RHYTHM_OTHER.
RHYTHMS: Tuple[str, ...] = (
    "(AB", "(AFIB", "(AFL", "(B", "(BII", "(IVR", "(N", "(NOD", "(P", "(PREX", "(SBR",
    "(SVTA", "(T", "(VFL", "(VT",
)
RHYTHM_OTHER = "(OTHER"

UNLABELED = "<unlabeled>"
LABEL_MODES: Tuple[str, ...] = ("aami", "raw")

# The inter-patient split of de Chazal et al. (2004); paced records 102 104 107 217 excluded.
MITDB_DS1: Tuple[str, ...] = tuple(
    "101 106 108 109 112 114 115 116 118 119 122 124 201 203 205 207 208 209 215 220 223 230".split()
)
MITDB_DS2: Tuple[str, ...] = tuple(
    "100 103 105 111 113 117 121 123 200 202 210 212 213 214 219 221 222 228 231 232 233 234".split()
)


def label_classes(label_mode: str) -> List[str]:
    """Label classes of a mode, in token order; the last is the unlabeled-beat class.

    Args:
        label_mode (str): ``"aami"`` (N S V F Q) or ``"raw"`` (every WFDB beat symbol).

    Returns:
        List[str]: class names; index = class id stored in shards.

    Raises:
        ValueError: unknown mode.
    """
    if label_mode == "aami":
        return [*AAMI_CLASSES, UNLABELED]
    if label_mode == "raw":
        return [*BEAT_SYMBOLS, UNLABELED]
    raise ValueError(f"label_mode must be one of {LABEL_MODES}, got {label_mode!r}")


def symbol_to_class(label_mode: str) -> Dict[str, int]:
    """Map every beat symbol to its class id under ``label_mode``.

    Args:
        label_mode (str): ``"aami"`` or ``"raw"``.

    Returns:
        Dict[str, int]: beat symbol -> class id.
    """
    classes = label_classes(label_mode)
    if label_mode == "raw":
        return {s: classes.index(s) for s in BEAT_SYMBOLS}
    return {s: classes.index(AAMI_MAP[s]) for s in BEAT_SYMBOLS}


def rhythm_name(aux_note: str) -> str:
    """Normalise a rhythm ``aux_note`` (strip NULs and spaces).

    Args:
        aux_note (str): raw aux_note of a '+' annotation, e.g. ``"(AFIB\\x00"``.

    Returns:
        str: e.g. ``"(AFIB"``; empty when the note holds no rhythm.
    """
    note = (aux_note or "").replace("\x00", "").strip()
    return note if note.startswith("(") else ""
