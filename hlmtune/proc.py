"""Child processes that die with their parent (Linux parent-death signal).

torchrun starts every rank in a new session (``start_new_session=True``), so a scheduler or a
closed terminal that kills the launcher's process group (``kill -9 -- -PGID``) does not reach
the ranks: they would train on, orphaned, and write into an ``output_dir`` a rerun uses. The
same holds for ``hlmtune tokenize``'s forked workers. ``prctl(PR_SET_PDEATHSIG)`` asks the
kernel to signal a process when the thread that created it exits, whatever killed it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from typing import Callable, List, Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_PID_ENV = "HLMTUNE_LAUNCHER_PID"  # pid of the process that starts the ranks (torchrun)
_BEFORE_FAST_EXIT: List[Callable[[], None]] = []


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: Optional[int] = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits.

    The parent may already be gone when this runs (the process was then re-parented to init
    or a subreaper): this is detected and ``sig`` is sent at once.

    Args:
        sig (int): signal to receive (SIGKILL: a rank blocked in a collective still dies).
        expected_parent (Optional[int]): the parent's pid when known (the pid before fork);
            without it, a parent pid of 1 means the parent is gone.

    Returns:
        bool: True when the signal is armed (Linux), False where prctl is unavailable.
    """
    prctl = _prctl()
    return prctl is not None and _arm(prctl, sig, expected_parent)


def _prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl`` (None off Linux, or where it cannot be found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _arm(prctl: Callable[..., int], sig: int, expected_parent: Optional[int]) -> bool:
    """Arm the parent-death signal with ``prctl``; send ``sig`` now if the parent is already gone."""
    code = int(sig)
    if prctl(PR_SET_PDEATHSIG, code, 0, 0, 0) != 0:
        return False
    ppid = os.getppid()
    if ppid == 1 or (expected_parent is not None and ppid != expected_parent):
        os.kill(os.getpid(), code)
    return True


def child_dies_with_us(sig: int = signal.SIGKILL) -> Optional[Callable[[], bool]]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``sig`` when this process ends.

    A driver that starts a long child (``hlmtune select`` its ``hlmtune cv``, ``cv`` and ``demo``
    their training stages) and is killed would otherwise leave that child training on, and the
    child's own children (torchrun's agent, then the ranks, which die with the agent: see
    :func:`die_with_parent`). Armed in every link, killing the top process ends the whole chain.

    The function runs in the child between fork and exec, so it only calls a ``prctl`` looked up
    here, in the parent (no import or library load after fork). The kernel signals the child when
    the *thread* that forked it exits: call ``Popen`` from the thread that lives as long as the
    process (the main thread, as every caller here does).

    Args:
        sig (int): signal the child gets (SIGKILL: a child that traps SIGTERM still dies).

    Returns:
        Optional[Callable[[], bool]]: the ``preexec_fn``, or None off Linux (no prctl), where the
        child outlives a killed parent as before.
    """
    prctl = _prctl()  # looked up here: the child then loads nothing between fork and exec
    if prctl is None:
        return None
    return functools.partial(_arm, prctl, sig, os.getpid())  # a new parent pid in the child: died before prctl


def launcher_pid() -> Optional[int]:
    """The launcher's pid that ``hlmtune run`` exported (None when started otherwise)."""
    try:
        return int(os.environ[LAUNCHER_PID_ENV])
    except (KeyError, ValueError):
        return None


def before_fast_exit(fn: Callable[[], None]) -> None:
    """Have ``fn`` run when this process ends through :func:`run_before_fast_exit` (``os._exit``).

    Register it with ``atexit`` as well for the normal way out; ``fn`` must tolerate a second call.

    Args:
        fn (Callable[[], None]): called without arguments, in registration order.
    """
    _BEFORE_FAST_EXIT.append(fn)


def run_before_fast_exit() -> None:
    """Run the :func:`before_fast_exit` callbacks; one that raises is reported and the rest still run."""
    while _BEFORE_FAST_EXIT:
        fn = _BEFORE_FAST_EXIT.pop(0)
        try:
            fn()
        except Exception as e:  # the process is ending: say so, never lose the others' work
            print(f"hlmtune: {getattr(fn, '__qualname__', fn)} failed before exit: {e!r}", file=sys.stderr)
