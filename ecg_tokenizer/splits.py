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
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
    extra_records: Any = None,
) -> List[str]:
    """Records a dataset reads.

    Args:
        split (str): ``DS1``, ``DS2`` or ``random`` (DS1 + DS2 pooled; beats split by hash).
        records (Optional[Sequence[str]]): an explicit list (overrides ``split``).
        split_file (Optional[str]): the split lists (None = MIT-BIH DS1/DS2).
        available (Sequence[str]): records in the token manifest.
        evaluation (bool): True only for :mod:`hlmtune.hlm.evaluate`; training datasets may not
            read DS2.
        extra_records (Any): more training patients beside the split's (:func:`extra_records`):
            a database of the shards (``svdb``), a list of record ids, or None / empty.

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
    asked = records_asked(split=split, records=records, lists=lists)
    chosen = match_records(asked, available)
    if not evaluation and split != RANDOM:
        test = set(lists[TEST]) | {r for r in match_records(lists[TEST], available) if r}
        leaked = sorted({a for a, r in zip(asked, chosen) if a in test or (r and r in test)})
        if leaked:
            raise SplitError(
                f"records {leaked} are test records (DS2): they are read only by `hlmtune eval`. "
                "Train on DS1 (the default) or ask for split: random explicitly"
            )
    missing = [a for a, r in zip(asked, chosen) if r is None]
    if missing:
        hint = (
            " (these are MIT-BIH names: for another database give split_file, or records)"
            if split_file is None and records is None else ""
        )
        raise SplitError(f"records {missing} are not in the token shards{hint}")
    extra = extra_records_of(extra_records, available, test=lists[TEST])
    order = {r: i for i, r in enumerate(available)}
    return sorted(dict.fromkeys([*chosen, *extra]), key=order.__getitem__)


def extra_records_of(extra: Any, available: Sequence[str], *, test: Sequence[str] = MITDB_DS2) -> List[str]:
    """The training records ``dataset.extra_records`` adds to the split's.

    Args:
        extra (Any): None, ``""`` or ``[]`` (none); a database name of the shards (``svdb``:
            every record whose id is ``svdb/...``); or a list of record ids / names.
        available (Sequence[str]): the shards' record ids.
        test (Sequence[str]): the test list; none of its records may be added.

    Returns:
        List[str]: record ids, in manifest order.

    Raises:
        SplitError: a database the shards do not hold, a record they do not hold, a test record.
    """
    if extra is None or extra == "" or (not isinstance(extra, str) and len(extra) == 0):
        return []
    if isinstance(extra, str):
        if "/" in extra or extra in available:
            asked = [extra]
        else:
            asked = [r for r in available if database_of(r) == extra]
            if not asked:
                dbs = sorted({database_of(r) for r in available} - {""})
                raise SplitError(
                    f"extra_records: {extra!r}: the shards hold no record of database {extra!r} "
                    f"(databases: {', '.join(dbs) or 'none named'}); tokenize that database into them "
                    f"(hlmtune tokenize --records ... {extra}=DIR --out <shards>) or set extra_records to null "
                    "(the split's records only)")
    else:
        asked = [str(r) for r in extra]
    got = match_records(asked, available)
    missing = [a for a, r in zip(asked, got) if r is None]
    if missing:
        raise SplitError(f"extra_records: records {missing} are not in the token shards")
    test_ids = {r for r in match_records(test, available) if r}
    leaked = sorted(r for r in got if r in test_ids)
    if leaked:
        raise SplitError(f"extra_records: {leaked} are test records: they are read only by `hlmtune eval`")
    return [r for r in available if r in set(got)]


def match_records(asked: Sequence[str], available: Sequence[str]) -> List[Optional[str]]:
    """Each asked record as the id the shards know it by, or None when they do not hold it.

    Shards of several databases name records ``<database>/<record>`` (``mitdb/100``,
    ``svdb/800``); a list may name them so, or by the record alone when only one database
    holds that name (``100``). A database-qualified name also finds the bare id of a shard set
    tokenized from one folder without a database name.

    Args:
        asked (Sequence[str]): record names from a split file, a ``records`` list or DS1/DS2.
        available (Sequence[str]): the shards' record ids.

    Returns:
        List[Optional[str]]: per asked name, its id or None.

    Raises:
        SplitError: a bare name that several databases of the shards hold.
    """
    ids = set(available)
    by_name: Dict[str, List[str]] = {}
    for r in available:
        by_name.setdefault(r.rsplit("/", 1)[-1], []).append(r)
    out: List[Optional[str]] = []
    for a in map(str, asked):
        if a in ids:
            out.append(a)
        elif "/" in a:
            bare = a.rsplit("/", 1)[-1]
            out.append(bare if bare in ids else None)
        else:
            hits = by_name.get(a, [])
            if len(hits) > 1:
                raise SplitError(f"record {a!r} is in several databases of the shards ({', '.join(sorted(hits))}): "
                                 "name it with its database")
            out.append(hits[0] if hits else None)
    return out


def database_of(record: str) -> str:
    """The database part of a record id (``mitdb/100`` -> ``mitdb``; a bare id -> ``""``)."""
    return record.rsplit("/", 1)[0] if "/" in record else ""


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


def check_disjoint(train: Sequence[str], test: Sequence[str], *, what: str = "run",
                   digests: Optional[Dict[str, str]] = None) -> None:
    """Refuse an evaluation whose test records were trained on.

    Args:
        train (Sequence[str]): training record ids.
        test (Sequence[str]): test record ids.
        what (str): what trained (for the message).
        digests (Optional[Dict[str, str]]): record id -> digest of its signal file: a record
            under two ids (the same file tokenized from two folders) counts as shared too.

    Raises:
        SplitError: naming the shared records.
    """
    both = sorted(set(train) & set(test))
    if both:
        raise SplitError(f"the {what}'s training records meet its test records: {both}; inter-patient results need disjoint patients")
    if digests:
        seen = {digests[r]: r for r in train if digests.get(r)}
        same = sorted(f"{seen[digests[r]]} = {r}" for r in test if digests.get(r) in seen)
        if same:
            raise SplitError(f"the {what}'s training records hold the same signal as test records ({', '.join(same)}): "
                             "inter-patient results need disjoint patients")


def shared_with_training(train: Sequence[str], test: Sequence[str], *,
                         digests: Optional[Dict[str, str]] = None) -> List[str]:
    """The test records that were trained on, by id or by signal (as :func:`check_disjoint`
    refuses them), in the order of ``test``.

    Args:
        train (Sequence[str]): training record ids.
        test (Sequence[str]): test record ids.
        digests (Optional[Dict[str, str]]): record id -> digest of its signal file.

    Returns:
        List[str]: the ids of ``test`` that meet ``train``.
    """
    trained, signals = set(train), {digests[r] for r in train if digests and digests.get(r)}
    return [r for r in test if r in trained or (digests is not None and digests.get(r) in signals)]


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
