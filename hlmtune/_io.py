"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one.

Every writer goes to a uniquely named temporary file in the destination's directory (same
filesystem, so the final ``os.replace`` is atomic), is flushed and fsynced, then renamed over
the destination; on any error the temporary file is removed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, IO


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = True) -> None:
    """Write ``path`` atomically with ``write(file)``.

    Args:
        path (str | os.PathLike): destination (parent directories are created).
        write (Callable[[IO], None]): fills the open temporary file.
        binary (bool): open in binary mode (text mode is UTF-8).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically write ``data`` to ``path``."""
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write UTF-8 ``text`` to ``path``."""
    atomic_write(path, lambda f: f.write(text), binary=False)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """Atomically ``torch.save`` ``obj`` to ``path`` (read back with ``weights_only=True``)."""
    import torch

    atomic_write(path, lambda f: torch.save(obj, f))
