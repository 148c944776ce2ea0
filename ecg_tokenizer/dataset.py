"""Training side: a map-style dataset of token windows read from memory-mapped shards.

Each sample is a window of ``max_seq_len`` tokens of one record's stream (windows never
cross records), starting every ``stride`` tokens, snapped back to the start of a beat so
a ``samples`` window never begins mid-beat. Samples follow torchtune's completion
datasets: ``{"tokens": [...], "labels": [...]}`` with ``labels == tokens`` (the recipe
shifts labels by one and ``padded_collate_sft`` pads labels with -100).

Only the window is copied out of the shard (``np.load(mmap_mode="r")``), so datasets
far larger than memory work; shards are opened lazily in each DataLoader worker.

YAML (torchtune recipes call ``config.instantiate(cfg.dataset, tokenizer)``)::

    dataset:
      _component_: hlmtune.ecg_tokenizer.dataset.ecg_tokens_dataset
      split: DS1          # MIT-BIH inter-patient train split; or records: [...]
      max_seq_len: 2048
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from torch.utils.data import Dataset

from hlmtune.ecg_tokenizer import splits as sp
from hlmtune.ecg_tokenizer.shards import read_manifest
from hlmtune.ecg_tokenizer.vocab import TokenizerParams


def open_token_shard(shards_dir: Path, record: Dict[str, Any]) -> np.ndarray:
    """Memory-map one record's token shard and check its length against the manifest.

    Args:
        shards_dir (Path): the shards' directory.
        record (Dict[str, Any]): the record's manifest entry.

    Returns:
        np.ndarray: (n_tokens,) read-only memory map.

    Raises:
        ValueError: the shard's length disagrees with the manifest (a truncated or replaced file).
    """
    m = np.load(Path(shards_dir) / record["outputs"]["tokens"]["file"], mmap_mode="r")
    if m.shape != (int(record["n_tokens"]),):
        raise ValueError(f"shard of record {record['record']} has shape {m.shape}, manifest says ({record['n_tokens']},)")
    return m


class ECGTokensDataset(Dataset):
    """Windows of token shards (map-style ``torch.utils.data.Dataset``).

    Args:
        shards_dir (Path): output directory of ``hlmtune tokenize``.
        max_seq_len (int): tokens per sample.
        stride (Optional[int]): tokens between window starts (default ``max_seq_len``).
        records (Optional[Sequence[str]]): records to use (default: all in the manifest).
        align_to_beats (bool): snap window starts back to beat starts.
        expected_params (Optional[TokenizerParams]): must equal the manifest's parameters.

    Raises:
        ValueError: parameter mismatch, unknown records, bad lengths.
    """

    def __init__(
        self,
        shards_dir: Path,
        *,
        max_seq_len: int,
        stride: Optional[int] = None,
        records: Optional[Sequence[str]] = None,
        align_to_beats: bool = True,
        expected_params: Optional[TokenizerParams] = None,
    ) -> None:
        manifest = read_manifest(Path(shards_dir))
        self.dir = Path(manifest["_dir"])
        if expected_params is not None:
            have = TokenizerParams.from_dict(manifest["params"])
            if have != expected_params:
                diff = {k: (v, getattr(have, k)) for k, v in expected_params.to_dict().items() if getattr(have, k) != v}
                raise ValueError(f"tokenizer parameters disagree with the shards in {self.dir}: (tokenizer, shards) {diff}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        stride = max_seq_len if stride is None else int(stride)
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.max_seq_len, self.stride = int(max_seq_len), stride
        by_name = {r["record"]: r for r in manifest["records"]}
        if records is None:
            chosen = sorted(by_name)
        else:
            missing = [r for r in records if r not in by_name]
            if missing:
                raise ValueError(f"records not in {self.dir / 'manifest.json'}: {missing}")
            chosen = list(records)
        self.records: List[Dict[str, Any]] = [by_name[r] for r in chosen]
        rec_idx, starts = [], []
        for i, r in enumerate(self.records):
            t = int(r["n_tokens"])
            beat_starts = None
            if align_to_beats and int(r["n_beats"]):
                beat_starts = np.asarray(np.load(self.dir / r["outputs"]["beats"]["file"], mmap_mode="r")["token_start"])
            s = self._starts(t, beat_starts)
            rec_idx.append(np.full(s.size, i, dtype=np.int64))
            starts.append(s)
        self._rec = np.concatenate(rec_idx) if rec_idx else np.zeros(0, np.int64)
        self._start = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self._maps: Dict[int, np.ndarray] = {}

    def _starts(self, t: int, beat_starts: Optional[np.ndarray]) -> np.ndarray:
        """Window starts of a ``t``-token record: every ``stride`` tokens, snapped back to
        the last beat start after the previous window start; consecutive windows overlap or
        touch (stride <= max_seq_len) so together they cover every token."""
        L, stride = self.max_seq_len, self.stride
        if beat_starts is None:
            s = np.arange(0, max(t - L, 0) + 1, stride, dtype=np.int64)
            if s[-1] + L < t:
                s = np.append(s, t - L)  # cover the tail
            return s
        out = [0]
        while out[-1] + L < t:
            cand = out[-1] + min(stride, L)
            j = int(np.searchsorted(beat_starts, cand, side="right")) - 1
            nxt = int(beat_starts[j]) if j >= 0 and beat_starts[j] > out[-1] else cand
            out.append(nxt)
        return np.asarray(out, dtype=np.int64)

    def _tokens(self, i: int) -> np.ndarray:
        m = self._maps.get(i)
        if m is None:
            m = self._maps[i] = open_token_shard(self.dir, self.records[i])
        return m

    def __len__(self) -> int:
        return int(self._start.size)

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        i, s = int(self._rec[index]), int(self._start[index])
        tokens = self._tokens(i)[s : s + self.max_seq_len].tolist()  # copies only the window
        return {"tokens": tokens, "labels": list(tokens)}

    def __getstate__(self) -> Dict[str, Any]:  # DataLoader workers re-open the maps
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state


def ecg_tokens_dataset(
    tokenizer: Any,
    *,
    shards_dir: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    stride: Optional[int] = None,
    split: Optional[str] = None,
    records: Optional[Sequence[str]] = None,
    split_file: Optional[str] = None,
    align_to_beats: bool = True,
) -> ECGTokensDataset:
    """Builder for YAML ``_component_`` (the recipe passes the tokenizer positionally).

    Args:
        tokenizer (ECGTokenizer): its parameters must match the shards; its
            ``manifest_dir`` is the default ``shards_dir`` and its ``max_seq_len`` the
            default window.
        shards_dir (Optional[str]): output directory of ``hlmtune tokenize``.
        max_seq_len (Optional[int]): tokens per sample (default ``tokenizer.max_seq_len``).
        stride (Optional[int]): tokens between window starts (default ``max_seq_len``).
        split (Optional[str]): ``"DS1"`` or ``"random"`` (the inter-patient split's train
            records, or DS1 + DS2 pooled); None (default): DS1 when the shards hold any test
            (DS2) record, else every record of the shards (a database without that split).
            DS2 is refused: it is read only by ``hlmtune eval``.
        records (Optional[Sequence[str]]): explicit record list (overrides ``split``; no DS2 record).
        split_file (Optional[str]): split lists of another database (default: MIT-BIH's).
        align_to_beats (bool): start windows at beat boundaries.

    Returns:
        ECGTokensDataset: the dataset.

    Raises:
        ValueError: missing shards_dir / max_seq_len, unknown split, DS2 records asked for,
            mismatched tokenizer.
    """
    shards = shards_dir or getattr(tokenizer, "manifest_dir", None)
    if shards is None:
        raise ValueError("ecg_tokens_dataset needs shards_dir (or a tokenizer built from manifest_path)")
    seq = max_seq_len or getattr(tokenizer, "max_seq_len", None)
    if not seq:
        raise ValueError("ecg_tokens_dataset needs max_seq_len (or a tokenizer with max_seq_len)")
    available = [r["record"] for r in read_manifest(Path(shards))["records"]]
    if split is None and records is None:
        # The shards of an inter-patient database hold its test records too (`hlmtune demo`
        # tokenizes DS1 + DS2 into one folder): training windows come from DS1 only.
        test = set(sp.load_split_file(split_file)[sp.TEST])
        split = sp.TRAIN if split_file is not None or test & set(available) else None
    if split is not None or records is not None:
        records = sp.resolve_records(split=split or sp.TRAIN, records=records, split_file=split_file,
                                     available=available)
    return ECGTokensDataset(
        Path(shards), max_seq_len=int(seq), stride=stride, records=records, align_to_beats=align_to_beats,
        expected_params=getattr(tokenizer, "params", None),
    )
