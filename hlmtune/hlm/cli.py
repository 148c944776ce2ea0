"""Subcommands of the Heart Language Model: ``hlmtune eval``, ``hlmtune demo`` (the main job), ``hlmtune cv``
and ``hlmtune select`` (a plan of cv candidates).

Imports nothing heavy at module top (``hlmtune --help`` stays fast).
"""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    """Add ``eval``, ``demo``, ``cv`` and ``select``."""
    from hlmtune.hlm import cv, evaluate, pipeline, select

    evaluate.register(subparsers)
    pipeline.register(subparsers)
    cv.register(subparsers)
    select.register(subparsers)
