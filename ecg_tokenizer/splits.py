"""Which records train and which test: the MIT-BIH inter-patient split and its guards.

de Chazal et al. (2004) split MIT-BIH by patient: DS1 (22 records) trains, DS2 (22 other
records) tests; the four paced records are in neither. Every ECG data builder defaults to DS1
and refuses DS2 records: DS2 is read only by :mod:`hlmtune.hlm.evaluate`, which also refuses a
run whose training records meet its test records.

Other databases (or the synthetic stand-in of ``hlmtune synth-ecg``) give their own split as a
JSON *split file* ``{"DS1": [...], "DS2": [...]}`` (``split_file`` in configs).

A random beat split (``split: random``) pools the beats of DS1 and DS2 and assigns each beat to
train or test by a seeded hash; it exists only when asked for, and every report then says on
its first line that its numbers are not comparable to inter-patient results.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hlmtune.ecg_tokenizer.labels import MITDB_DS1, MITDB_DS2

TRAIN, TEST = "DS1", "DS2"
RANDOM = "random"
SPLIT_NAMES = (TRAIN, TEST, RANDOM)
RANDOM_SPLIT_NOTICE = (
    "RANDOM BEAT SPLIT: beats of the same patients are in train and test; these numbers are NOT "
    "comparable to inter-patient (DS1 -> DS2) results"
)


class SplitError(ValueError):
    """A split that would leak test patients into training, or that cannot be resolved."""


def load_split_file(path: Optional[str]) -> Dict[str, Tuple[str, ...]]:
    """The split lists: MIT-BIH's DS1/DS2, or a split file's.

    Args:
        path (Optional[str]): JSON ``{"DS1": [...], "DS2": [...]}``; None = MIT-BIH.

    Returns:
        Dict[str, Tuple[str, ...]]: ``{"DS1": ..., "DS2": ...}``.

    Raises:
        SplitError: unreadable file, missing lists, or records in both.
    """
    if path is None:
        return {TRAIN: MITDB_DS1, TEST: MITDB_DS2}
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise SplitError(f"split_file: no file at {p}") from None
    except ValueError as e:
        raise SplitError(f"split_file {p}: not JSON ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in (TRAIN, TEST)):
        raise SplitError(f"split_file {p}: must hold lists 'DS1' (train) and 'DS2' (test)")
    # Names compared as the strings the shards use: 100 and "100" are one record.
    lists = {k: tuple(map(str, data[k])) for k in (TRAIN, TEST)}
    both = sorted(set(lists[TRAIN]) & set(lists[TEST]))
    if both:
        raise SplitError(f"split_file {p}: records in both DS1 and DS2: {both}")
    return lists


def resolve_records(
    *,
    split: str,
    records: Optional[Sequence[str]],
    split_file: Optional[str],
    available: Sequence[str],
    evaluation: bool = False,
) -> List[str]:
    """Records a dataset reads.

    Args:
        split (str): ``DS1``, ``DS2`` or ``random`` (DS1 + DS2 pooled; beats split by hash).
        records (Optional[Sequence[str]]): an explicit list (overrides ``split``).
        split_file (Optional[str]): the split lists (None = MIT-BIH DS1/DS2).
        available (Sequence[str]): records in the token manifest.
        evaluation (bool): True only for :mod:`hlmtune.hlm.evaluate`; training datasets may not
            read DS2.

    Returns:
        List[str]: record names, in manifest order.

    Raises:
        SplitError: unknown split, test records asked for in training, records missing from
            the shards.
    """
    lists = load_split_file(split_file)
    if split not in SPLIT_NAMES:
        import difflib

        close = difflib.get_close_matches(str(split), SPLIT_NAMES, n=1)
        raise SplitError(f"split must be one of {SPLIT_NAMES}, got {split!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    chosen = records_asked(split=split, records=records, lists=lists)
    test = set(lists[TEST])
    if not evaluation and split != RANDOM:
        leaked = sorted(set(chosen) & test)
        if leaked:
            raise SplitError(
                f"records {leaked} are test records (DS2): they are read only by `hlmtune eval`. "
                "Train on DS1 (the default) or ask for split: random explicitly"
            )
    have = set(available)
    missing = [r for r in chosen if r not in have]
    if missing:
        hint = (
            " (these are MIT-BIH names: for another database give split_file, or records)"
            if split_file is None and records is None else ""
        )
        raise SplitError(f"records {missing} are not in the token shards{hint}")
    order = {r: i for i, r in enumerate(available)}
    return sorted(chosen, key=order.__getitem__)


def records_asked(*, split: str, records: Optional[Sequence[str]], lists: Dict[str, Tuple[str, ...]]) -> List[str]:
    """The records a dataset section asks for (``records`` wins over ``split``), unchecked.

    Args:
        split (str): ``DS1``, ``DS2`` or ``random`` (both lists).
        records (Optional[Sequence[str]]): an explicit list.
        lists (Dict[str, Tuple[str, ...]]): :func:`load_split_file`'s lists.

    Returns:
        List[str]: record names.
    """
    if records is not None:
        return [str(r) for r in records]
    if split == RANDOM:
        return list(lists[TRAIN]) + list(lists[TEST])
    return list(lists[split])


def check_disjoint(train: Sequence[str], test: Sequence[str], *, what: str = "run") -> None:
    """Refuse an evaluation whose test records were trained on.

    Raises:
        SplitError: naming the shared records.
    """
    both = sorted(set(train) & set(test))
    if both:
        raise SplitError(f"the {what}'s training records meet its test records: {both}; inter-patient results need disjoint patients")


def random_beat_mask(record: str, n_beats: int, *, seed: int, test_fraction: float) -> np.ndarray:
    """Test membership of each beat of a record under the random beat split.

    A seeded hash of (record, beat index): deterministic, the same in the training dataset and
    in evaluation, independent of the order records are read in.

    Args:
        record (str): record name.
        n_beats (int): beats in the record's table.
        seed (int): split seed.
        test_fraction (float): share of beats in test (0..1).

    Returns:
        np.ndarray: (n_beats,) bool, True = test beat.
    """
    key = hashlib.sha256(f"{seed}:{record}".encode()).digest()
    rng = np.random.default_rng(np.frombuffer(key[:8], dtype="<u8")[0])
    return rng.random(n_beats) < float(test_fraction)
