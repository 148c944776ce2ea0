"""A run's ``output_dir``: checked before anything is written, and held by one live run.

Two runs writing one ``output_dir`` corrupt each other's checkpoints and metrics (a resumed
run next to an orphaned one that is still training). Rank 0 takes a lock file,
``<output_dir>/.hlmtune-run.lock``, for the life of the run:

- the lock is an advisory ``flock`` on that file, which the kernel drops when the holder
  dies however it dies, so a lock left by a killed run is stale by construction and is taken
  over; the file records the holder (``pid``, ``host``, start time, command) for the message
  a second run gets;
- where ``flock`` is not supported (some network file systems), the recorded holder decides:
  a dead pid on this host is stale and taken over; a live one, or one on another host (whose
  processes cannot be checked from here), refuses the run, naming the file to delete once no
  run is live;
- a finished run removes the file.

Before that, every rank checks what would otherwise fail later as a traceback: an
``output_dir`` or metric-logger ``log_dir`` that is a file, and ``resume_from_checkpoint``
without a checkpoint to resume.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from hlmtune.files import OutputPathError, check_dir_path, ensure_dir
from hlmtune.training.errors import RunError

LOCK_NAME = ".hlmtune-run.lock"

# Locks this process holds, by resolved output_dir: a second recipe object in the same process
# (in-process tests, a notebook) shares it instead of refusing itself.
_HELD: Dict[Path, "RunDirLock"] = {}


class OutputDirInUse(RunError):
    """Another live run holds the ``output_dir``."""


class RunDirLock:
    """The lock a live run holds on its ``output_dir`` (see the module docstring).

    Args:
        path (Path): the lock file.
        fd (int): its open descriptor (holding the ``flock``).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: Optional[int] = fd
        self._users = 1

    @classmethod
    def acquire(cls, output_dir: str | os.PathLike) -> "RunDirLock":
        """Take the lock of ``output_dir`` (created if needed).

        Args:
            output_dir (str | os.PathLike): the run's output folder.

        Returns:
            RunDirLock: the held lock; call :meth:`release` when the run ends.

        Raises:
            OutputDirInUse: a live run holds it.
            RunError: ``output_dir`` cannot be a directory.
        """
        try:
            d = ensure_dir(output_dir, "output_dir").resolve()
        except OutputPathError as e:
            raise RunError(str(e)) from None
        held = _HELD.get(d)
        if held is not None and held._fd is not None:
            held._users += 1
            return held
        path = d / LOCK_NAME
        for _ in range(10):  # retried only when a finishing run removes the file under us
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                if not _try_flock(fd, path):
                    owner = _read_owner(fd)
                    raise OutputDirInUse(_in_use_message(d, path, owner))
                try:
                    same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
                except FileNotFoundError:
                    same_file = False
                if not same_file:  # the previous holder released (unlinked) it meanwhile
                    os.close(fd)
                    continue
                _write_owner(fd)
            except BaseException:
                if _fd_open(fd):
                    os.close(fd)
                raise
            lock = cls(path, fd)
            _HELD[d] = lock
            return lock
        raise RunError(f"output_dir {d}: could not take {path} (it keeps being replaced); is another run starting?")

    def release(self) -> None:
        """Release the lock and remove the file (the last user in this process does)."""
        if self._fd is None:
            return
        self._users -= 1
        if self._users > 0:
            return
        try:
            os.unlink(self.path)  # while still holding it: a waiting run then retries on a new file
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        _HELD.pop(self.path.parent, None)


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _try_flock(fd: int, path: Path) -> bool:
    """True when this process now holds ``fd``'s lock; False when a live run holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    # No flock on this file system: the recorded holder decides.
    owner = _read_owner(fd)
    return owner is None or _is_stale(owner)


def _is_stale(owner: Dict[str, Any]) -> bool:
    """A recorded holder that is certainly gone: a dead pid on this host."""
    if owner.get("host") != socket.gethostname():
        return False  # its processes cannot be checked from here
    try:
        pid = int(owner["pid"])
    except (KeyError, TypeError, ValueError):
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _read_owner(fd: int) -> Optional[Dict[str, Any]]:
    try:
        raw = os.pread(fd, 65536, 0)
        owner = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _write_owner(fd: int) -> None:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
    os.fsync(fd)


def _in_use_message(d: Path, path: Path, owner: Optional[Dict[str, Any]]) -> str:
    who = "another run"
    if owner:
        who = f"a live run (pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')})"
    return (
        f"output_dir {d} is in use by {who}: wait for it to finish or stop it, or give this run "
        f"another output_dir=...; if no run is live there, delete {path}"
    )


def _log_dirs(cfg: DictConfig) -> Iterator[Tuple[str, str]]:
    """(key, value) of every ``log_dir`` in the metric logger section (wrapped loggers too)."""
    section = cfg.get("metric_logger", None)
    if section is None:
        return
    data = OmegaConf.to_container(section, resolve=True)
    stack = [("metric_logger", data)]
    while stack:
        prefix, node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                key = f"{prefix}.{k}"
                if k == "log_dir" and isinstance(v, str):
                    yield key, v
                elif isinstance(v, dict):
                    stack.append((key, v))


def check_run_dirs(cfg: DictConfig) -> None:
    """Problems with the run's folders that would fail later as a traceback (any rank).

    Args:
        cfg (DictConfig): the recipe config.

    Raises:
        RunError: ``output_dir`` or a metric logger ``log_dir`` is (under) a file, or
            ``resume_from_checkpoint`` is set with no complete checkpoint in ``output_dir``.
    """
    from hlmtune.training import checkpoint as ckpt  # torch: imported only when a recipe checks

    # A DiskLogger given a file as log_dir fails in __init__ and again in __del__ (its
    # ``_file`` was never set), the second error hiding the first: check before building it.
    for key, value in [("output_dir", str(cfg.output_dir)), *_log_dirs(cfg)]:
        try:
            check_dir_path(value, key)
        except OutputPathError as e:
            raise RunError(str(e)) from None
    if cfg.get("resume_from_checkpoint", False) and ckpt.latest_checkpoint(cfg.output_dir) is None:
        raise RunError(
            f"resume_from_checkpoint=True but {ckpt.checkpoint_root(cfg.output_dir)} holds no complete checkpoint "
            f"(step_<N>/state.json): run without it to start fresh, or set output_dir to the run to resume "
            f"(checkpoints are written every save_every_n_steps and at epoch ends)"
        )
