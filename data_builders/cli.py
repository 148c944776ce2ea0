"""``hlmtune data-report``: token counts per dataset and template.

Registration only at import time: torch/torchtune/datasets are imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

# Names accepted by --dataset (kept here, not imported from report.py, to stay import-light;
# tests check they match report.BUILDERS).
DATASET_NAMES = ("alpaca_cleaned", "grammar", "samsum", "slimorca", "stack_exchange_paired", "hh_rlhf")
_FILE_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def parse_dataset_arg(value: str, *, split: str = "train") -> Dict[str, Any]:
    """Parse ``NAME`` (hub source) or ``NAME=FILE`` (local json/jsonl/parquet).

    Args:
        value (str): the ``--dataset`` value.
        split (str): split to load.

    Returns:
        Dict[str, Any]: a dataset spec for ``token_count_report``.
    """
    name, sep, path = value.partition("=")
    name = name.strip()
    if name not in DATASET_NAMES:
        import difflib

        close = difflib.get_close_matches(name, DATASET_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise argparse.ArgumentTypeError(f"unknown dataset {name!r}{hint}; known: {', '.join(DATASET_NAMES)}")
    spec: Dict[str, Any] = {"name": name, "split": split}
    if sep:
        ext = os.path.splitext(path)[1].lower()
        if ext not in _FILE_LOADERS:
            raise argparse.ArgumentTypeError(f"{path}: expected a .json, .jsonl or .parquet file")
        spec.update(source=_FILE_LOADERS[ext], data_files=path)
    return spec


def _tokenizer_arg(value: str) -> Any:
    """``--tokenizer``: a tokenizer.model path, a YAML file with a ``tokenizer`` section (a
    recipe config) or a ``_component_`` spec, or an inline YAML/JSON mapping."""
    import yaml

    if value.lstrip().startswith("{"):
        return yaml.safe_load(value)
    if value.endswith((".yaml", ".yml")):
        with open(value, "r", encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
        if not isinstance(cfg, dict):
            raise ValueError(f"{value}: expected a YAML mapping")
        spec = cfg.get("tokenizer", cfg)
        if not isinstance(spec, dict) or "_component_" not in spec:
            raise ValueError(f"{value}: no tokenizer _component_ found (top level or under 'tokenizer')")
        return spec
    return value


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add ``data-report`` to the ``hlmtune`` command.

    Args:
        subparsers (argparse._SubParsersAction): the ``hlmtune`` subparsers.
    """
    p = subparsers.add_parser(
        "data-report",
        help="token counts per dataset and prompt template",
        description=(
            "Tokenize datasets with their prompt templates and report, per dataset and template: "
            "rows, total/mean/median/p90/max tokens, prompt vs target tokens and rows longer "
            "than max_seq_len. Prints a Markdown (or CSV) table; --json also writes JSON."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--dataset",
        action="append",
        required=True,
        metavar="NAME[=FILE]",
        help=(
            f"dataset to report, repeatable. NAME is one of {', '.join(DATASET_NAMES)}; without "
            "=FILE the hub dataset is loaded, with =FILE a local .json/.jsonl/.parquet file"
        ),
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help=(
            "Llama3 tokenizer.model path, a YAML file (recipe config with a 'tokenizer' section, "
            "or a _component_ spec), or an inline mapping such as "
            "'{_component_: torchtune.models.llama3.llama3_tokenizer, path: /m/tokenizer.model}'"
        ),
    )
    p.add_argument("--special-tokens-path", default=None, help="special tokens tokenizer.json for a tokenizer.model path")
    p.add_argument("--max-seq-len", type=int, default=None, help="length above which a row counts as truncated (default: the tokenizer's)")
    p.add_argument("--split", default="train", help="split to load")
    p.add_argument("--subset-size", type=int, default=None, help="report on this many rows per dataset (seeded subset; the paper used 500)")
    p.add_argument("--subset-seed", type=int, default=0, help="seed of the subset")
    p.add_argument("--on-bad-row", choices=("error", "skip"), default="error", help="bad rows: stop with an error, or skip and count them")
    p.add_argument("--format", choices=("markdown", "csv"), default="markdown", help="table format")
    p.add_argument("--output", default=None, help="write the table to this file (atomically) instead of stdout")
    p.add_argument("--json", dest="json_path", default=None, help="also write the report as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``data-report``.

    Args:
        args (argparse.Namespace): parsed arguments.

    Returns:
        int: 0 on success, 2 on bad input (unknown dataset, missing file, bad row).
    """
    try:
        specs: List[Dict[str, Any]] = [parse_dataset_arg(v, split=args.split) for v in args.dataset]
        tokenizer = _tokenizer_arg(args.tokenizer)
    except (argparse.ArgumentTypeError, ValueError, OSError) as e:
        print(f"hlmtune data-report: error: {e}", file=sys.stderr)
        return 2

    from hlmtune.data_builders.loading import BadRowError
    from hlmtune.data_builders.report import format_report, token_count_report, write_report_json, atomic_write_text

    try:
        rows = token_count_report(
            datasets=specs,
            tokenizer=tokenizer,
            special_tokens_path=args.special_tokens_path,
            max_seq_len=args.max_seq_len,
            subset_size=args.subset_size,
            subset_seed=args.subset_seed,
            on_bad_row=args.on_bad_row,
            progress=not args.no_progress,
        )
    except (BadRowError, ValueError, OSError) as e:
        print(f"hlmtune data-report: error: {e}", file=sys.stderr)
        return 2
    table = format_report(rows, args.format)
    if args.output:
        atomic_write_text(args.output, table)
    else:
        sys.stdout.write(table)
    if args.json_path:
        write_report_json(rows, args.json_path)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``data-report`` standalone (``python -m hlmtune.data_builders.cli``)."""
    parser = argparse.ArgumentParser(prog="hlmtune")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data-report", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
