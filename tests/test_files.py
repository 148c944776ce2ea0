"""Atomic writes: complete content or the old file, and no temporary left behind."""

from __future__ import annotations

import pytest
import torch

from hlmtune.files import atomic_torch_save, atomic_write, atomic_write_bytes, atomic_write_text


def test_writes_and_replaces(tmp_path):
    p = tmp_path / "sub" / "a.txt"
    atomic_write_text(p, "one")
    atomic_write_text(p, "two ✓")
    assert p.read_text(encoding="utf-8") == "two ✓"
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    atomic_torch_save({"w": torch.arange(3)}, tmp_path / "c.pt")
    assert torch.equal(torch.load(tmp_path / "c.pt", weights_only=True)["w"], torch.arange(3))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["b.bin", "c.pt", "sub"]


def test_failed_write_keeps_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "a.txt"
    atomic_write_text(p, "old")

    def boom(f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(p, boom)
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["a.txt"]


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_files_honour_the_umask(tmp_path, umask, mode):
    """mkstemp creates 0600 files; a shared shard or report must get what open() would give."""
    import os

    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        atomic_write_bytes(tmp_path / "a.txt", b"y")  # a replacement gets the umask mode too
        with open(tmp_path / "plain.txt", "w") as f:  # what a plain open() gives, for comparison
            f.write("z")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == mode
    assert (tmp_path / "plain.txt").stat().st_mode & 0o777 == mode
