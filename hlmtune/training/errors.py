"""Errors the user fixes, reported by a recipe process as one line with exit status 2.

A recipe runs as ``python -m hlmtune.recipes.<name>`` (one process) or as torchrun's ranks;
either way nothing above the recipe catches its exceptions, so a missing checkpoint or an
``output_dir`` in use would print a traceback. :class:`RunError` marks those problems and
:func:`install_exit_hook` turns an uncaught one into ``error: <message>`` and exit status 2
(``hlmtune run`` passes a rank's status and error line on). Other exceptions keep their
traceback: they are bugs or environment failures worth the stack.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Optional, Type

EXIT_USER_ERROR = 2


class RunError(Exception):
    """A problem with the run's inputs or outputs that the user fixes (one line, exit 2)."""


def install_exit_hook() -> None:
    """Report an uncaught :class:`RunError` as one line and exit 2 (idempotent)."""
    if getattr(sys.excepthook, "_hlmtune", False):
        return
    previous = sys.excepthook

    def hook(kind: Type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        if not issubclass(kind, RunError):
            previous(kind, value, tb)
            return
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        prefix = f"[rank {os.environ.get('RANK', '?')}] " if world > 1 else ""
        print(f"{prefix}error: {value}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Past this hook the interpreter would exit with 1. The run stops here: its process
        # group and worker threads need no orderly shutdown.
        os._exit(EXIT_USER_ERROR)

    hook._hlmtune = True  # type: ignore[attr-defined]
    sys.excepthook = hook
