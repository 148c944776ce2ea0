"""Subcommands of the Heart Language Model: ``hlmtune eval`` and ``hlmtune demo`` (the main job).

Imports nothing heavy at module top (``hlmtune --help`` stays fast).
"""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    """Add ``eval`` and ``demo``."""
    from hlmtune.hlm import evaluate, pipeline

    evaluate.register(subparsers)
    pipeline.register(subparsers)
