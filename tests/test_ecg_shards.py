"""Shard files and manifest: atomic writes, schema, checksums."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from hlmtune.ecg_tokenizer.core import BEAT_DTYPE
from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
from hlmtune.ecg_tokenizer.shards import atomic_write_bytes, read_manifest
from hlmtune.ecg_tokenizer.vocab import TokenizerParams


def test_atomic_write_failure_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "x.npy"
    atomic_write_bytes(target, b"old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["x.npy"]


def test_manifest_schema_and_checksums(real_mitdb_dir, tmp_path):
    out = tmp_path / "out"
    s = tokenize_directory(real_mitdb_dir, out, params=TokenizerParams(), options=RecordOptions(sampto=360 * 30),
                           records=["102", "201"], progress=False)
    m = read_manifest(out)
    assert m["format"] == "hlmtune.ecg_tokens" and m["format_version"] == 2 and m["scheme"] == "samples"
    assert set(m) >= {"params", "options", "run_digest", "vocab", "token_dtype", "libraries", "totals", "records", "failed"}
    assert m["options"]["sampto"] == 360 * 30 and m["token_dtype"] == "<u2"
    assert len(m["vocab"]["tokens"]) == m["vocab"]["size"] == m["vocab"]["layout"]["size"]
    assert set(m["libraries"]) == {"hlmtune", "wfdb", "numpy", "scipy", "python"}
    assert m["totals"]["beats"] == sum(r["n_beats"] for r in m["records"]) == s.beats
    r102 = m["records"][0]
    assert r102["lead"] == "V5" and "MLII absent" in r102["notes"][0]
    r201 = m["records"][1]
    assert r201["rhythm_counts"] and sum(r201["rhythm_counts"].values()) == r201["n_beats"]
    for r in m["records"]:
        for name, sha in r["inputs"].items():
            assert hashlib.sha256((real_mitdb_dir / name).read_bytes()).hexdigest() == sha
        for kind, o in r["outputs"].items():
            data = (out / o["file"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == o["sha256"] and len(data) == o["bytes"]
        tokens = np.load(out / r["outputs"]["tokens"]["file"], mmap_mode="r")
        beats = np.load(out / r["outputs"]["beats"]["file"], mmap_mode="r")
        assert tokens.shape == (r["n_tokens"],) and beats.dtype == BEAT_DTYPE and beats.shape == (r["n_beats"],)
        assert r["beats_found"] == r["n_beats"] + r["n_dropped"] == r["annotated_beats"]
    meta = json.loads((out / "records" / "201.json").read_text())
    assert meta["run_digest"] == m["run_digest"]


def test_read_manifest_rejects_other_files(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not an ECG token manifest"):
        read_manifest(tmp_path)


def test_version_1_shards_name_the_rebuild_command(tmp_path):
    """Version-1 shards wrote labels into the samples stream: refused, with the command to rebuild."""
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "hlmtune.ecg_tokens", "format_version": 1}))
    with pytest.raises(ValueError, match=r"label.*Rebuild them: `hlmtune tokenize --records <WFDB dir> --out "):
        read_manifest(tmp_path)


def test_a_truncated_shard_is_named_with_its_sizes_and_the_fix(mitdb_dir, tmp_path, hlmtune_cli):
    """Damaged input names the file, its size, the expected size and the rebuild command; --verify
    checks every hash."""
    import subprocess

    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
    from hlmtune.ecg_tokenizer.shards import ShardError, read_manifest
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    out = tmp_path / "tok"
    tokenize_directory(mitdb_dir, out, params=TokenizerParams(), options=RecordOptions(sampto=36000),
                       records=["100", "101"], progress=False)
    ok = subprocess.run([hlmtune_cli, "tokenize", "--verify", str(out)], capture_output=True, text=True)
    assert ok.returncode == 0 and "every shard matches" in ok.stdout
    shard = out / "records" / "100.tokens.npy"
    want = shard.stat().st_size
    data = shard.read_bytes()
    shard.write_bytes(data[:1000])
    with pytest.raises(ShardError, match=rf"100.tokens.npy: 1000 bytes, the manifest expects {want} .*record 100.*"
                                         rf"hlmtune tokenize --records .* --out {out}"):
        read_manifest(out)
    bad = subprocess.run([hlmtune_cli, "tokenize", "--verify", str(out)], capture_output=True, text=True)
    assert bad.returncode == 1 and "1000 bytes" in bad.stderr
    # same size, other bytes: only the hash tells
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    flipped = subprocess.run([hlmtune_cli, "tokenize", "--verify", str(out)], capture_output=True, text=True)
    assert flipped.returncode == 1 and "100.tokens.npy: SHA-256 differs" in flipped.stderr
    assert "101" not in flipped.stderr  # the other record is fine
