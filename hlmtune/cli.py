"""The ``hlmtune`` command line.

Each subsystem owns its subcommands: a module with ``register(subparsers)`` that adds its
parsers and sets ``func`` (called with the parsed ``argparse.Namespace``, returns an exit
code). Registration modules must import quickly: no torch/torchtune at module top.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# Modules whose ``register(subparsers)`` adds subcommands, in help order.
_SUBCOMMAND_MODULES = (
    "hlmtune._cli_core",  # ls, cp, run, validate, demo
    "hlmtune.data_builders.cli",  # data-report
    "hlmtune.ecg_tokenizer.cli",  # tokenize, download, synth-ecg
    "hlmtune.hlm.cli",  # eval, the Heart Language Model's main job (demo)
    "hlmtune.profiling.cli",  # collect, profile
    "hlmtune.sweep.cli",  # sweep
    "hlmtune.gpu_check",  # gpu-check
)


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered subcommand.

    Returns:
        argparse.ArgumentParser: the parser.
    """
    parser = argparse.ArgumentParser(
        prog="hlmtune",
        description=(
            "torchtune recipe pack: LoRA/QLoRA/DPO/QAT recipes and configs, ECG heartbeat "
            "tokenizer, profiling. Run `hlmtune <command> --help` for details."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``hlmtune`` console script.

    Args:
        argv (Optional[List[str]]): arguments without the program name; ``sys.argv[1:]``
            when None.

    Returns:
        int: process exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # torchrun options come before the recipe; argparse's REMAINDER cannot take leading
        # flags, so `run` parses its own arguments (with torchrun's parser).
        from hlmtune._cli_core import run_cli

        return run_cli(argv[1:])
    if argv and argv[0] == "validate":
        # Overrides may follow the recipe and --config (argparse's plain parse cannot).
        from hlmtune._cli_core import validate_cli

        return validate_cli(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
