"""The ``--help`` formatters of the pack's commands (no torch import: registration stays light)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help when the default says something.

    Not for required options, defaults of None / False / SUPPRESS / [] (flags, "unset", a
    repeatable option not given), or help
    that already states its default in words ("default: the tokenizer's"): argparse's
    ``ArgumentDefaultsHelpFormatter`` would add "(default: None)" beside those. ``0`` is a
    default worth showing (``0 == False`` in Python, hence the identity checks).
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        d = action.default
        empty = isinstance(d, (list, tuple)) and not d  # a repeatable option given no times
        if action.required or d is None or d is False or d is argparse.SUPPRESS or empty or "default" in h:
            return h
        return h + " (default: %(default)s)"


class RawDefaultsHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`DefaultsHelpFormatter` that keeps the description and epilog (examples) as written."""
