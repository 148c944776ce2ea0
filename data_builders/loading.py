"""Row loading, validation, bad-row policy and equal-size subsets shared by every builder.

The builders of this package load rows with ``datasets.load_dataset`` exactly like torchtune's
(a hub name by default, ``source="json"``/``"parquet"`` with ``data_files`` for local files),
then, **before any tokenization**, walk the rows the dataset will serve and check each one with
a per-dataset ``check(row) -> Optional[str]`` (missing field, wrong type, empty target). A bad
row is either a :class:`BadRowError` naming the file and the row, or skipped and counted
(``on_bad_row="skip"``).

Row numbers in messages are 0-based row indices of the loaded split; for JSON Lines files the
1-based line number of the file is given as well (``samsum.jsonl row 17 (0-based), line 18``).

Local JSON files that ``load_dataset`` cannot read at all (a field changes type between rows,
a line is not valid JSON: pyarrow rejects the whole file) are re-read line by line here so the
error still names the line, and so ``on_bad_row="skip"`` can drop just that line.
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import itertools
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

log = logging.getLogger(__name__)

# ``datasets`` packaged builders that read local files given through ``data_files``.
LOCAL_LOADERS = ("json", "parquet", "csv", "arrow", "text")
# A ``source`` that is itself a path to one of these files is loaded with the matching builder.
_EXTENSION_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
ON_BAD_ROW_CHOICES = ("error", "skip")
# Rows are read from the Arrow table in chunks: one ``ds[list]`` call per chunk is ~100x faster
# than one ``ds[i]`` per row.
_CHUNK = 1024
# How many skipped rows are named one by one in the log.
_LOG_EXAMPLES = 5

# Checks return None for a good row or a short problem such as "field 'summary' is empty".
RowCheck = Callable[[Mapping[str, Any]], Optional[str]]


class BadRowError(ValueError):
    """A row failed validation; the message names the file (or hub dataset) and the row.

    Args:
        problem (str): where and what (file, row, line, reason).
        skippable (bool): ``on_bad_row="skip"`` would drop the row; the message then says so
            in config terms, and :attr:`problem` lets a command line name its own flag.
    """

    SKIP_HINT = "set on_bad_row='skip' to skip and count bad rows"

    def __init__(self, problem: str, *, skippable: bool = False) -> None:
        super().__init__(f"{problem} ({self.SKIP_HINT})" if skippable else problem)
        self.problem = problem
        self.skippable = skippable


@dataclass
class PreparedRows:
    """Rows a builder will serve, validated and (optionally) subset.

    Attributes:
        data (datasets.Dataset): the selected rows, in source order.
        row_indices (List[int]): 0-based index of each selected row in the loaded split
            (after concatenating ``data_files`` in order).
        skipped_rows (int): bad rows skipped (``on_bad_row="skip"``); 0 otherwise.
        skipped_examples (List[str]): where the first few skipped rows are and what was wrong.
        source_label (str): the file(s) or hub dataset the rows came from.
    """

    data: Any
    row_indices: List[int]
    skipped_rows: int = 0
    skipped_examples: List[str] = field(default_factory=list)
    source_label: str = ""


# --------------------------------------------------------------------------------------------
# Row checks (building blocks of the per-dataset ``check`` functions)
# --------------------------------------------------------------------------------------------


def check_text_field(row: Mapping[str, Any], key: str, *, allow_empty: bool = False) -> Optional[str]:
    """Check that ``row[key]`` is a string, non-empty unless ``allow_empty``.

    Args:
        row (Mapping[str, Any]): one dataset row.
        key (str): column name (after ``column_map``).
        allow_empty (bool): accept "", whitespace-only and a missing/null value (alpaca's
            optional ``input``). Default False.

    Returns:
        Optional[str]: None when fine, else the problem ("field 'summary' is empty").
    """
    value = row.get(key) if isinstance(row, Mapping) else None
    if value is None:
        if allow_empty:
            return None
        if key not in row:
            return f"field {key!r} is missing (columns: {sorted(row)})"
        return f"field {key!r} is missing (null)"
    if not isinstance(value, str):
        return f"field {key!r} has type {type(value).__name__}, expected str"
    if not allow_empty and not value.strip():
        # Tokenizers strip message content (Llama3Tokenizer does), so whitespace is empty too.
        return f"field {key!r} is empty"
    return None


def check_message_list(
    messages: Any,
    key: str,
    *,
    role_key: str,
    content_key: str,
    role_map: Mapping[str, str],
) -> Optional[str]:
    """Check a conversation: a non-empty list of ``{role_key, content_key}`` dicts forming a
    valid turn order (optional system first, then user/assistant alternating, starting with
    user), ending with a non-empty assistant message (the training target).

    Args:
        messages (Any): the column value.
        key (str): column name, for the message.
        role_key (str): key of the role in each turn ("role" for OpenAI, "from" for ShareGPT).
        content_key (str): key of the text ("content" / "value").
        role_map (Mapping[str, str]): dataset role name -> "system" | "user" | "assistant".

    Returns:
        Optional[str]: None when fine, else the problem.
    """
    if messages is None:
        return f"field {key!r} is missing"
    if not isinstance(messages, (list, tuple)):
        return f"field {key!r} has type {type(messages).__name__}, expected a list of turns"
    if len(messages) < 2:
        return f"field {key!r} has {len(messages)} turn(s), expected at least a user and an assistant turn"
    previous = None
    for i, turn in enumerate(messages):
        where = f"field {key!r} turn {i}"
        if not isinstance(turn, Mapping):
            return f"{where} has type {type(turn).__name__}, expected a dict"
        raw_role = turn.get(role_key)
        if raw_role not in role_map:
            return f"{where}: {role_key!r} is {raw_role!r}, expected one of {sorted(role_map)}"
        content = turn.get(content_key)
        if not isinstance(content, str):
            return f"{where}: {content_key!r} has type {type(content).__name__}, expected str"
        role = role_map[raw_role]
        if role == "system" and i != 0:
            return f"{where}: system message after the first turn"
        if role == "user" and previous == "user":
            return f"{where}: two user turns in a row"
        if role == "assistant" and previous != "user":
            return f"{where}: assistant turn not preceded by a user turn"
        previous = role
    if previous != "assistant":
        return f"field {key!r}: last turn is {previous!r}, expected the assistant's (the target)"
    if not messages[-1][content_key].strip():
        return f"field {key!r}: the last assistant turn (the target) is empty"
    return None


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def is_local_source(source: str) -> bool:
    """Whether ``source`` names a local file loader ("json", "parquet", ...) rather than a hub
    dataset."""
    return source in LOCAL_LOADERS


def _expand_files(data_files: Any) -> Optional[List[str]]:
    """Concrete file list for ``data_files`` given as a path, glob or list; None for a dict
    (per-split mapping, passed to ``load_dataset`` untouched)."""
    if data_files is None or isinstance(data_files, Mapping):
        return None
    items = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    files: List[str] = []
    for item in items:
        item = os.fspath(item)
        if any(ch in item for ch in "*?[") and not os.path.exists(item):
            matches = sorted(glob.glob(item))
            if not matches:
                raise FileNotFoundError(f"data_files pattern {item!r} matches no file")
            files.extend(matches)
        else:
            files.append(item)
    return files


def _jsonl_line_number(path: str, row: int) -> Optional[int]:
    """1-based line of the ``row``-th (0-based) JSON object of a JSON Lines file (blank lines
    are skipped by the reader), or None for a JSON array file / unreadable file."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            seen = -1
            for lineno, line in enumerate(f, start=1):
                stripped = line.strip()
                if lineno == 1 and stripped.startswith("["):
                    return None
                if stripped:
                    seen += 1
                    if seen == row:
                        return lineno
    except (OSError, UnicodeDecodeError):
        return None
    return None


@dataclass
class _Loaded:
    data: Any
    files: Optional[List[str]]  # local files in concatenation order, None for hub / dict
    offsets: List[int]  # first row index of each file
    source: str
    split: str
    pre_skipped: List[str] = field(default_factory=list)  # rows dropped by the line reader
    pre_skipped_count: int = 0
    # For files read line by line with rows dropped: original row index of each kept row.
    original_rows: Optional[List[List[int]]] = None

    def where(self, index: int) -> str:
        """Human-readable location of row ``index`` of ``data``."""
        if not self.files:
            return f"{self.source} (split {self.split!r}) row {index} (0-based)"
        k = int(np.searchsorted(self.offsets, index, side="right")) - 1
        path = self.files[k]
        local = index - self.offsets[k]
        if self.original_rows is not None and self.original_rows[k] is not None:
            local = self.original_rows[k][local]
        return _file_row(path, local)


def _file_row(path: str, row: int, line: Optional[int] = None) -> str:
    if line is None and path.endswith((".jsonl", ".json")):
        line = _jsonl_line_number(path, row)
    suffix = f", line {line}" if line is not None else ""
    return f"{path} row {row} (0-based){suffix}"


def _read_json_rows(path: str) -> Iterator[Tuple[int, Optional[int], Any, Optional[str]]]:
    """Yield ``(row, line, value, parse_error)`` for a JSON Lines or JSON array file."""
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadRowError(f"{path}: not valid JSON ({e})") from e
        for i, value in enumerate(values):
            yield i, None, value, None
        return
    row = -1
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row += 1
        try:
            yield row, lineno, json.loads(line), None
        except json.JSONDecodeError as e:
            yield row, lineno, None, f"not valid JSON ({e.msg}: column {e.colno})"


@contextlib.contextmanager
def _json_reader_quiet() -> Iterator[None]:
    """Mute the ``datasets`` JSON reader's own ``ERROR: Failed to load JSON`` record while a local
    file loads: a file it cannot read is diagnosed row by row below (file, row, line), so its
    record only repeats the problem, once per rank, in pyarrow's words."""
    logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _load_json_by_lines(
    path: str, *, check: RowCheck, on_bad_row: str, original_error: BaseException
) -> Tuple[Any, List[int], List[str], int]:
    """Fallback reader for a local JSON file pyarrow rejected: find the bad line(s).

    Returns:
        Tuple: (datasets.Dataset of the good rows, their original row indices, descriptions of
        the first skipped rows, number of skipped rows).
    """
    import datasets

    good: List[Any] = []
    good_rows: List[int] = []
    examples: List[str] = []
    skipped = 0
    for row, line, value, parse_error in _read_json_rows(path):
        problem = parse_error
        if problem is None and not isinstance(value, Mapping):
            problem = f"is a JSON {type(value).__name__}, expected an object"
        if problem is None:
            problem = check(value)
        if problem is None:
            good.append(value)
            good_rows.append(row)
            continue
        message = f"{_file_row(path, row, line)}: {problem}"
        if on_bad_row == "error":
            raise BadRowError(message, skippable=True) from original_error
        skipped += 1
        if len(examples) < _LOG_EXAMPLES:
            examples.append(message)
    try:
        data = datasets.Dataset.from_list(good)
    except Exception as e:  # rows pass the checks but a column outside them changes type
        raise BadRowError(
            f"{path}: load_dataset failed ({original_error}) and the rows could not be "
            f"combined after dropping {skipped} bad row(s): {e}. A column the builder does "
            "not check probably changes type between rows."
        ) from e
    return data, good_rows, examples, skipped


def load_split(
    source: str,
    *,
    data_files: Any,
    split: str,
    check: RowCheck,
    on_bad_row: str,
    load_dataset_kwargs: Dict[str, Any],
) -> _Loaded:
    """``datasets.load_dataset`` with file names kept for error messages.

    Several local files are loaded one by one (when ``split`` is a plain name) and concatenated
    in order, so a row index maps back to its file.
    """
    import datasets

    if source.endswith(tuple(_EXTENSION_LOADERS)) and data_files is None:
        # ``source="/data/alpaca.jsonl"``: a convenience for a single local file.
        data_files, source = source, _EXTENSION_LOADERS[os.path.splitext(source)[1]]
    if is_local_source(source) and data_files is None and "data_dir" not in load_dataset_kwargs:
        raise ValueError(
            f"source={source!r} loads local files: pass data_files (a path, glob or list of paths)"
        )
    files = _expand_files(data_files)
    if files is not None:
        missing = [f for f in files if "://" not in f and not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"data_files not found: {missing}")
    plain_split = re.fullmatch(r"[\w\-]+", split) is not None
    if not files or not plain_split:
        try:
            data = datasets.load_dataset(source, data_files=data_files, split=split, **load_dataset_kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised with what to do about it
            if is_local_source(source):
                raise
            raise RuntimeError(
                f"could not load hub dataset {source!r} (split {split!r}): {type(e).__name__}: {e}. "
                "Without internet, or for a hub repository that only has a loading script (datasets>=4 "
                "no longer runs them), download the data and pass source='json' or 'parquet' with "
                "data_files, or a parquet mirror of the dataset as source."
            ) from e
        label = ", ".join(files) if files else source
        return _Loaded(data=data, files=None, offsets=[0], source=label, split=split)

    parts, offsets, pre_examples, originals = [], [], [], []
    pre_skipped, total = 0, 0
    for path in files:
        try:
            with _json_reader_quiet():
                part = datasets.load_dataset(source, data_files=path, split=split, **load_dataset_kwargs)
            original = None
        except Exception as e:  # noqa: BLE001 - any reader failure gets a row-level diagnosis
            if source != "json":
                raise
            part, original, examples, skipped = _load_json_by_lines(
                path, check=check, on_bad_row=on_bad_row, original_error=e
            )
            pre_examples.extend(examples)
            pre_skipped += skipped
        parts.append(part)
        originals.append(original)
        offsets.append(total)
        total += len(part)
    data = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return _Loaded(
        data=data,
        files=files,
        offsets=offsets,
        source=", ".join(files),
        split=split,
        pre_skipped=pre_examples,
        pre_skipped_count=pre_skipped,
        original_rows=originals,
    )


# --------------------------------------------------------------------------------------------
# Validation walk + subset
# --------------------------------------------------------------------------------------------


# Above this many rows a full permutation array (8 bytes/row) is not built for a subset: the
# visit order is drawn lazily instead (C4_200M has ~185M rows, 1.5 GB as int64).
_PERMUTATION_LIMIT = 20_000_000


def _visit_order(n: int, subset_size: Optional[int], seed: int) -> Iterator[int]:
    """Order in which rows are validated: source order without a subset, else a seeded
    random permutation (uniform, without replacement, identical for the same ``n`` and seed)."""
    if subset_size is None:
        yield from range(n)
        return
    rng = np.random.default_rng(seed)
    if n <= _PERMUTATION_LIMIT:
        yield from (int(i) for i in rng.permutation(n))
        return
    # Lazy sampling without replacement: draw, drop repeats. Cheap while the subset is a small
    # fraction of the split, which is the point of subsetting a huge split.
    seen: set = set()
    while len(seen) < n:
        for i in rng.integers(0, n, size=_CHUNK).tolist():
            if i not in seen:
                seen.add(i)
                yield i


def _iter_rows(data: Any, order: Iterable[int]) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """Yield ``(index, row)`` for ``order``, reading the table in chunks."""
    columns = list(data.column_names)
    it = iter(order)
    while True:
        chunk = list(itertools.islice(it, _CHUNK))
        if not chunk:
            return
        batch = data[chunk]
        for j, index in enumerate(chunk):
            yield index, {c: batch[c][j] for c in columns}


def _scan_rows(name: str, loaded: Any, order: Any, check: RowCheck, on_bad_row: str, subset_size: Optional[int],
               filter_fn: Optional[Callable[[Mapping[str, Any]], bool]]) -> Tuple[List[int], int, int, List[str]]:
    """Visit rows in ``order`` until ``subset_size`` good ones pass ``filter_fn`` (all rows without it).

    Returns:
        Tuple[List[int], int, int, List[str]]: (kept row indices, bad rows skipped, rows
        removed by the filter, the first bad rows' messages).
    """
    from tqdm.auto import tqdm

    keep: List[int] = []
    examples = list(loaded.pre_skipped)
    skipped = loaded.pre_skipped_count
    filtered = 0
    n = len(loaded.data)
    # The bar shows only on a terminal and for big splits (hub datasets).
    total = n if subset_size is None else subset_size
    bar = tqdm(total=total, desc=f"{name}: checking rows", unit="row", disable=None if n > 50_000 else True)
    try:
        for index, row in _iter_rows(loaded.data, order):
            problem = check(row)
            if problem is not None:
                message = f"{loaded.where(index)}: {problem}"
                if on_bad_row == "error":
                    raise BadRowError(f"{name}: {message}", skippable=True)
                skipped += 1
                if len(examples) < _LOG_EXAMPLES:
                    examples.append(message)
                continue
            if filter_fn is not None and not filter_fn(row):
                filtered += 1
                continue
            keep.append(index)
            bar.update(1)
            if subset_size is not None and len(keep) == subset_size:
                break
    finally:
        bar.close()
    return keep, skipped, filtered, examples


def prepare_rows(
    *,
    name: str,
    source: str,
    data_files: Any,
    split: str,
    check: RowCheck,
    on_bad_row: str = "error",
    subset_size: Optional[int] = None,
    subset_seed: int = 0,
    filter_fn: Optional[Callable[[Mapping[str, Any]], bool]] = None,
    load_dataset_kwargs: Optional[Dict[str, Any]] = None,
) -> PreparedRows:
    """Load, validate, filter and subset the rows of one builder.

    Without ``subset_size`` every row is checked in order. With it, rows are visited in the
    order of a permutation drawn from ``numpy.random.default_rng(subset_seed)`` and the first
    ``subset_size`` good rows that pass ``filter_fn`` are kept (then served in source order):
    a uniform sample of the good rows, identical on every run, and a huge hub split is not
    read beyond what the subset needs. Bad rows met on the way are errors or skipped.

    Args:
        name (str): builder name, for messages.
        source (str): hub dataset name or local loader ("json", "parquet").
        data_files (Any): local file(s) for a local loader.
        split (str): split to load.
        check (RowCheck): per-row validation.
        on_bad_row (str): "error" (default) or "skip".
        subset_size (Optional[int]): keep this many rows (equal-size subsets per template).
        subset_seed (int): seed of the subset permutation.
        filter_fn (Optional[Callable]): keep a row only when ``filter_fn(row)`` is true (applied
            after validation; filtered rows are not counted as bad).
        load_dataset_kwargs (Optional[Dict[str, Any]]): more ``load_dataset`` arguments.

    Returns:
        PreparedRows: the rows and the skip count.

    Raises:
        BadRowError: a bad row with ``on_bad_row="error"``.
        ValueError: bad arguments, or ``subset_size`` larger than the rows available.
    """
    if on_bad_row not in ON_BAD_ROW_CHOICES:
        raise ValueError(f"{name}: on_bad_row={on_bad_row!r}, expected one of {ON_BAD_ROW_CHOICES}")
    if subset_size is not None:
        if isinstance(subset_size, bool) or not isinstance(subset_size, int) or subset_size <= 0:
            raise ValueError(f"{name}: subset_size must be a positive int or None, got {subset_size!r}")
    loaded = load_split(
        source,
        data_files=data_files,
        split=split,
        check=check,
        on_bad_row=on_bad_row,
        load_dataset_kwargs=dict(load_dataset_kwargs or {}),
    )
    data = loaded.data
    n = len(data)
    keep, skipped, filtered, examples = _scan_rows(name, loaded, _visit_order(n, subset_size, subset_seed), check,
                                                   on_bad_row, subset_size, filter_fn)
    if subset_size is not None and len(keep) < subset_size:
        raise ValueError(
            f"{name}: subset_size={subset_size} but {loaded.source} has only {len(keep)} usable "
            f"rows ({n} loaded, {skipped} bad and skipped, {filtered} removed by filter_fn)"
        )
    keep.sort()
    if skipped:
        log.warning(
            "%s: skipped %d bad row(s) of %s; first: %s", name, skipped, loaded.source, "; ".join(examples)
        )
    selected = data if len(keep) == n else data.select(keep)
    return PreparedRows(
        data=selected,
        row_indices=keep,
        skipped_rows=skipped,
        skipped_examples=examples,
        source_label=loaded.source,
    )


def reject_typos(name: str, kwargs: Mapping[str, Any], known: Sequence[str]) -> None:
    """Raise on an extra keyword that looks like a misspelt builder argument.

    Builders forward unknown keywords to ``datasets.load_dataset`` (like torchtune's), which
    accepts arbitrary builder-config keys, so a typo such as ``subset_sise`` would otherwise be
    silently ignored or fail deep inside ``datasets``.

    Args:
        name (str): builder name.
        kwargs (Mapping[str, Any]): the extra keywords.
        known (Sequence[str]): the builder's own keyword names.

    Raises:
        TypeError: naming the closest known key.
    """
    load_params = {
        "name", "data_dir", "cache_dir", "features", "download_config", "download_mode",
        "verification_mode", "keep_in_memory", "save_infos", "revision", "token", "streaming",
        "num_proc", "storage_options", "trust_remote_code", "field",
    }
    for key in kwargs:
        if key in load_params:
            continue
        close = difflib.get_close_matches(key, list(known) + sorted(load_params), n=1, cutoff=0.75)
        if close:
            raise TypeError(f"{name}: unknown argument {key!r}; did you mean {close[0]!r}?")
    if kwargs.get("streaming"):
        raise ValueError(f"{name}: streaming=True is not supported (rows are validated and subset up front)")
