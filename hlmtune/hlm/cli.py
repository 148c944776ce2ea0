"""Subcommands of the Heart Language Model: ``hlmtune eval``, ``hlmtune demo`` (the main job) and ``hlmtune cv``.

Imports nothing heavy at module top (``hlmtune --help`` stays fast).
"""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    """Add ``eval``, ``demo`` and ``cv``."""
    from hlmtune.hlm import cv, evaluate, pipeline

    evaluate.register(subparsers)
    pipeline.register(subparsers)
    cv.register(subparsers)
