"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one.

Every writer goes to a uniquely named temporary file in the destination's directory (same
filesystem, so the final ``os.replace`` is atomic), is flushed and fsynced, then renamed over
the destination; on any error the temporary file is removed. ``mkstemp`` creates its file with
mode 0600, which the rename would keep: the file gets ``0666 & ~umask`` first, as ``open()``
would give, so shards and reports shared by a group stay readable by it.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, IO


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status`` on Linux).

    The portable way (set it, read the old value, set it back) briefly leaves the umask at
    0 for every thread of the process; it is used only where ``/proc`` lacks the field.

    Returns:
        int: the umask (e.g. ``0o022``).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _UMASK_LOCK:
        old = os.umask(0o077)
        os.umask(old)
    return old


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
        os.fchmod(fd, 0o666 & ~current_umask())
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


class OutputPathError(ValueError):
    """An output location that cannot be a directory (a file is in the way, or no permission)."""


def check_dir_path(path: str | os.PathLike, what: str) -> Path:
    """Check, without creating anything, that ``path`` is or can become a directory.

    Args:
        path (str | os.PathLike): the directory.
        what (str): how the user named it, for the message (``--out``, ``output_dir``).

    Returns:
        Path: the directory path.

    Raises:
        OutputPathError: ``path`` or one of its parents is a file.
    """
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            where = "is a file" if p == path else f"cannot be created: {p} is a file"
            raise OutputPathError(f"{what} {path}: {where}, not a directory; give a directory path (new or existing)")
        if p.exists():
            break
    return path


def ensure_dir(path: str | os.PathLike, what: str) -> Path:
    """Create the output directory ``path`` (and parents), or say in one line why it cannot be.

    Args:
        path (str | os.PathLike): the directory.
        what (str): how the user named it, for the message (``--out``, ``output_dir``).

    Returns:
        Path: the directory.

    Raises:
        OutputPathError: ``path`` or one of its parents is a file, or it cannot be created.
    """
    path = check_dir_path(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"{what} {path}: cannot be created ({e.strerror}); give a directory you can write") from None
    return path
