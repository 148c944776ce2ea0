"""Token shards on disk: atomic per-record files, a done marker, and the run manifest.

Layout of an output directory::

    manifest.json                 written last by every run (see docs/ecg_tokenizer.md)
    records/<stem>.tokens.npy     (n_tokens,) uint16/uint32 token ids   - np.load(mmap_mode="r")
    records/<stem>.beats.npy      (n_beats,) core.BEAT_DTYPE rows       - np.load(mmap_mode="r")
    records/<stem>.lead2.npy      (n_beats, window) second-lead sample tokens (``second_lead`` only)
    records/<stem>.json           per-record metadata; written last = the record is done

``<stem>`` is the record name with ``/`` replaced by ``__``. Every file is written to a
temporary name in the same directory, fsynced and renamed, so a crash never leaves a file
that looks complete; a record counts as done only when its ``.json`` exists, its
``run_digest`` matches the current parameters, its inputs still hash the same and its
outputs hash to what the ``.json`` says.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from hlmtune.ecg_tokenizer.core import TokenizedRecord, get_vocab
from hlmtune.files import atomic_write_bytes  # noqa: F401  (re-exported: callers import it from here)
from hlmtune.ecg_tokenizer.records import EcgRecord, sha256_file
from hlmtune.ecg_tokenizer.vocab import TokenizerParams

FORMAT = "hlmtune.ecg_tokens"
# 2: ``samples`` beats carry no label token (``<sep> [rr] q...q``) and the vocabulary ends
#    with task tokens. Version-1 shards put the label before the beat's waveform.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
RECORDS_SUBDIR = "records"


def json_bytes(obj: Any) -> bytes:
    """Canonical JSON (sorted keys, no NaN) so equal content gives equal bytes."""
    return (json.dumps(obj, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()


def npy_bytes(arr: np.ndarray) -> bytes:
    """``.npy`` serialisation of an array (no pickle)."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def stem(name: str) -> str:
    """File stem of a record name (``a/b`` -> ``a__b``)."""
    return name.replace("/", "__")


def run_digest(params: TokenizerParams, options: Dict[str, Any]) -> str:
    """sha256 of everything that decides a record's outputs."""
    blob = json.dumps({"params": params.to_dict(), "options": options, "format": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _clean(d: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Replace NaN by None (strict JSON)."""
    if d is None:
        return None
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in d.items()}


def write_record(
    out_dir: Path, rec: EcgRecord, tok: TokenizedRecord, params: TokenizerParams, digest: str,
    source: Optional[str] = None,
) -> Dict[str, Any]:
    """Write one record's shards and, last, its metadata (the done marker).

    Args:
        out_dir (Path): output directory.
        rec (EcgRecord): the record read.
        tok (TokenizedRecord): its tokens.
        params (TokenizerParams): parameters.
        digest (str): :func:`run_digest` of the run.
        source (Optional[str]): the WFDB files' path without extension (``hlmtune eval --beats
            detector`` reads the signal again from there).

    Returns:
        Dict[str, Any]: the metadata written.
    """
    rdir = Path(out_dir) / RECORDS_SUBDIR
    rdir.mkdir(parents=True, exist_ok=True)
    s = stem(rec.name)
    classes = get_vocab(params).classes
    outputs = {}
    arrays = [("tokens", tok.tokens), ("beats", tok.beats)] + ([("lead2", tok.lead2)] if tok.lead2 is not None else [])
    for kind, arr in arrays:
        data = npy_bytes(arr)
        fname = f"{s}.{kind}.npy"
        atomic_write_bytes(rdir / fname, data)
        outputs[kind] = {
            "file": f"{RECORDS_SUBDIR}/{fname}", "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data), "shape": list(arr.shape), "dtype": arr.dtype.str if arr.dtype.names is None else "BEAT_DTYPE",
        }
    lab = np.bincount(tok.beats["label"].astype(np.int64), minlength=len(classes))
    rh = tok.beats["rhythm"].astype(np.int64)
    rh_counts = np.bincount(rh + 1, minlength=len(rec.rhythms) + 1)
    rhythm_counts = {("(unknown)" if i == 0 else rec.rhythms[i - 1]): int(c) for i, c in enumerate(rh_counts) if c}
    meta = {
        "record": rec.name,
        "run_digest": digest,
        **({"source": source} if source else {}),
        "fs": rec.fs,
        "n_samples": rec.n_samples,
        "lead": rec.lead,
        **({"lead2": rec.lead2} if tok.lead2 is not None else {}),
        "notes": list(rec.notes),
        "beat_source": rec.beat_source,
        "annotated_beats": rec.annotated_beats,
        "beats_found": int(rec.beat_samples.size),
        "n_beats": int(tok.beats.size),
        "n_dropped": len(tok.dropped),
        "dropped": tok.dropped,
        "n_tokens": int(tok.tokens.size),
        "label_counts": {c: int(n) for c, n in zip(classes, lab) if n},
        "rhythms": list(rec.rhythms),
        "rhythm_counts": rhythm_counts,
        "detector": _clean(rec.detector),
        "inputs": dict(sorted(rec.inputs.items())),
        "outputs": outputs,
    }
    atomic_write_bytes(rdir / f"{s}.json", json_bytes(meta))
    return meta


def finished_meta(records_dir: Path, out_dir: Path, name: str, digest: str,
                  record_id: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The metadata of a record already tokenized with the same parameters, else None.

    Checks: the ``.json`` marker parses, its ``run_digest`` matches, every input file
    still has the recorded sha256, every output file has the recorded sha256.

    Args:
        records_dir (Path): database directory.
        out_dir (Path): output directory.
        name (str): record name in ``records_dir``.
        digest (str): current :func:`run_digest`.
        record_id (Optional[str]): the record's id in the shards (``mitdb/100``; default ``name``).

    Returns:
        Optional[Dict[str, Any]]: the metadata, or None when the record must be (re)done.
    """
    rid = record_id or name
    path = Path(out_dir) / RECORDS_SUBDIR / f"{stem(rid)}.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("run_digest") != digest or meta.get("record") != rid:
        return None
    base = (Path(records_dir) / name).parent
    try:
        for fname, sha in meta["inputs"].items():
            if sha256_file(base / fname) != sha:
                return None
        for out in meta["outputs"].values():
            if sha256_file(Path(out_dir) / out["file"]) != out["sha256"]:
                return None
    except (OSError, KeyError):
        return None
    return meta


def library_versions() -> Dict[str, str]:
    """Versions of the libraries that shape the tokens."""
    from importlib import metadata

    import scipy
    import wfdb

    try:
        own = metadata.version("hlmtune")
    except metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
        own = "unknown"
    return {
        "hlmtune": own, "wfdb": wfdb.__version__, "numpy": np.__version__,
        "scipy": scipy.__version__, "python": platform.python_version(),
    }


def build_manifest(
    params: TokenizerParams,
    options: Dict[str, Any],
    digest: str,
    metas: List[Dict[str, Any]],
    failed: List[Dict[str, str]],
) -> Dict[str, Any]:
    """The run manifest (deterministic: sorted, no timestamps, no machine details).

    Args:
        params (TokenizerParams): parameters.
        options (Dict[str, Any]): record-reading options.
        digest (str): run digest.
        metas (List[Dict]): metadata of every finished record.
        failed (List[Dict]): ``{"record", "reason"}`` of every failed record.

    Returns:
        Dict[str, Any]: the manifest.
    """
    vocab = get_vocab(params)
    metas = sorted(metas, key=lambda m: m["record"])
    labels: Dict[str, int] = {}
    rhythms: Dict[str, int] = {}
    det = {"tp": 0, "fn": 0, "fp": 0, "records": 0}
    for m in metas:
        for k, v in m["label_counts"].items():
            labels[k] = labels.get(k, 0) + v
        for k, v in m["rhythm_counts"].items():
            rhythms[k] = rhythms.get(k, 0) + v
        if m.get("detector"):
            det["records"] += 1
            for k in ("tp", "fn", "fp"):
                det[k] += m["detector"][k]
    if det["records"]:
        det["sensitivity"] = det["tp"] / max(1, det["tp"] + det["fn"])
        det["positive_predictivity"] = det["tp"] / max(1, det["tp"] + det["fp"])
    records = [
        {k: m[k] for k in (
            "record", "fs", "n_samples", "lead", "notes", "beat_source", "annotated_beats", "beats_found",
            "n_beats", "n_dropped", "dropped", "n_tokens", "label_counts", "rhythm_counts", "detector",
            "inputs", "outputs",
        )} | ({"source": m["source"]} if m.get("source") else {}) | ({"lead2": m["lead2"]} if m.get("lead2") else {})
        for m in metas
    ]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "scheme": params.scheme,
        "params": params.to_dict(),
        "options": options,
        "run_digest": digest,
        "vocab": {"size": len(vocab), "layout": vocab.layout(), "label_classes": vocab.classes, "tokens": vocab.names},
        "token_dtype": vocab.dtype.str,
        "libraries": library_versions(),
        "totals": {
            "records": len(metas),
            "failed": len(failed),
            "beats": sum(m["n_beats"] for m in metas),
            "dropped": sum(m["n_dropped"] for m in metas),
            "tokens": sum(m["n_tokens"] for m in metas),
            "label_counts": dict(sorted(labels.items())),
            "rhythm_counts": dict(sorted(rhythms.items())),
            "detector": det if det["records"] else None,
        },
        "records": records,
        "failed": sorted(failed, key=lambda f: f["record"]),
    }


def read_manifest(path: Path) -> Dict[str, Any]:
    """Load a manifest (a directory means its ``manifest.json``) and check its format.

    Args:
        path (Path): manifest file or output directory.

    Returns:
        Dict[str, Any]: the manifest, with ``"_dir"`` set to its directory.

    Raises:
        FileNotFoundError: no manifest.
        ValueError: not an ECG token manifest, or an unsupported version.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"no ECG token manifest at {path} (run `hlmtune tokenize` first)")
    m = json.loads(path.read_text())
    if m.get("format") != FORMAT:
        raise ValueError(f"{path} is not an ECG token manifest (format {m.get('format')!r})")
    if m.get("format_version") != FORMAT_VERSION:
        why = (
            " (version 1 wrote each beat's label into the samples stream, before its waveform: a model "
            "reading it sees the answer)" if m.get("format_version") == 1 else ""
        )
        raise ValueError(
            f"{path}: ECG token shards of format_version {m.get('format_version')}{why}; this hlmtune reads "
            f"version {FORMAT_VERSION}. Rebuild them: `hlmtune tokenize --records <WFDB dir> --out {path.parent}` "
            "with the same options"
        )
    m["_dir"] = str(path.parent)
    check_sizes(m)
    return m


class ShardError(ValueError):
    """A shard file that is not the one its manifest describes (truncated, replaced, missing)."""


def _rebuild_hint(manifest: Dict[str, Any]) -> str:
    return (f"rebuild it: `hlmtune tokenize --records <WFDB folder(s)> --out {manifest['_dir']}` with the same "
            "options (finished records are kept)")


def check_sizes(manifest: Dict[str, Any]) -> None:
    """Every output file of the manifest exists with the size it records (one ``stat`` each).

    Raises:
        ShardError: naming the file, its size, the size the manifest expects, and the rebuild command.
    """
    d = Path(manifest["_dir"])
    for r in manifest.get("records", []):
        for o in (r.get("outputs") or {}).values():
            f = d / o["file"]
            try:
                size = f.stat().st_size
            except OSError:
                raise ShardError(f"{f}: missing (record {r['record']}; the manifest expects {o['bytes']} bytes); "
                                 + _rebuild_hint(manifest)) from None
            if size != int(o["bytes"]):
                raise ShardError(f"{f}: {size} bytes, the manifest expects {o['bytes']} (record {r['record']}: "
                                 "truncated or replaced); " + _rebuild_hint(manifest))


def verify_shards(path: Path) -> List[str]:
    """Check every output file's SHA-256 against the manifest (``hlmtune tokenize --verify``).

    Args:
        path (Path): the shards' folder (or its manifest).

    Returns:
        List[str]: one line per file that differs (empty: all match).

    Raises:
        ShardError: a file missing or of the wrong size (:func:`check_sizes`).
    """
    m = read_manifest(path)
    d = Path(m["_dir"])
    bad = []
    for r in m["records"]:
        for o in r["outputs"].values():
            if sha256_file(d / o["file"]) != o["sha256"]:
                bad.append(f"{d / o['file']}: SHA-256 differs from the manifest's (record {r['record']})")
    return bad
