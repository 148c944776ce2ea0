"""``hlmtune data-report``: token counts per dataset and template.

Registration only at import time: torch/torchtune/datasets are imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hlmtune.helpformat import DefaultsHelpFormatter

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


def _tokenizer_arg(value: str, sets: Sequence[str] = ()) -> Any:
    """``--tokenizer``: a tokenizer.model path, a pack config name or YAML file with a
    ``tokenizer`` section (a recipe config) or a ``_component_`` spec, or an inline YAML/JSON
    mapping. A config is read whole, so ``${model_dir}``-style paths resolve; ``sets``
    (``--set KEY=VALUE``) override its keys first."""
    import yaml

    if value.lstrip().startswith("{"):
        return yaml.safe_load(value)
    path = _config_file(value)
    if path is None:
        if sets:
            raise ValueError(f"--set applies to a --tokenizer config, but {value} is not one (a .yaml file or pack config name)")
        return value
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError

    from hlmtune.compat import yaml_error_line

    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ValueError(f"--tokenizer {yaml_error_line(str(path), e)}") from None
    if not OmegaConf.is_dict(cfg):
        raise ValueError(f"--tokenizer {path}: expected a YAML mapping")
    bad = [s for s in sets if "=" not in s]
    if bad:
        raise ValueError(f"--set {bad[0]}: expected KEY=VALUE (e.g. --set model_dir=/models/llama3)")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(sets)))
    key = "tokenizer" if "tokenizer" in cfg else None
    node = cfg[key] if key else cfg
    where = f"--tokenizer {value}"
    if not OmegaConf.is_dict(node) or "_component_" not in node:
        raise ValueError(f"{where}: no tokenizer _component_ found (top level or under 'tokenizer')")
    raw = OmegaConf.to_container(node, resolve=False)
    spec = {}
    for k in raw:
        name = f"{key}.{k}" if key else k
        try:
            v = node[k]  # resolved against the whole config: ${model_dir} is a top-level key
            spec[k] = OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
        except (InterpolationKeyError, InterpolationResolutionError) as e:
            refs = _REF.findall(str(raw[k])) or ["..."]
            raise ValueError(
                f"{where}: {name} needs '{refs[0]}', which the config does not set ({type(e).__name__}): "
                f"add --set {refs[0]}=..."
            ) from None
        if k in _TOKENIZER_FILES and isinstance(spec[k], str) and not os.path.exists(spec[k]):
            refs = _REF.findall(str(raw[k]))
            fix = f"give --set {refs[0]}=<folder> (now {OmegaConf.select(cfg, refs[0])})" if refs else f"fix {name} in the config"
            raise ValueError(f"{where}: {name} {spec[k]} does not exist: {fix}")
    return spec


# ``${model_dir}`` references in a config value (the keys a user can --set).
_REF = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")
_TOKENIZER_FILES = ("path", "special_tokens_path", "merges_file", "vocab_path")


def _config_file(value: str) -> Optional[Path]:
    """The YAML file ``--tokenizer`` names (a path or a pack config name), or None (a tokenizer file)."""
    if value.endswith((".yaml", ".yml")):
        if not os.path.isfile(value):
            raise ValueError(f"--tokenizer {value}: no such file")
        return Path(value)
    if os.path.exists(value):
        return None
    from importlib import resources

    # a pack config by name (the YAML files of the `hlmtune.configs` data package); read from
    # the package itself so the data layer needs nothing of the recipe registry above it
    stem = value[:-5] if value.endswith(".yaml") else value
    path = Path(str(resources.files("hlmtune.configs"))) / f"{stem}.yaml"
    return path if path.is_file() else None


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
        formatter_class=DefaultsHelpFormatter,
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
            "Llama3 tokenizer.model path, a pack config name (e.g. llama3_8b_lora_alpaca) or YAML file "
            "(recipe config with a 'tokenizer' section, or a _component_ spec; its ${model_dir}-style "
            "paths resolve, see --set), or an inline mapping such as "
            "'{_component_: torchtune.models.llama3.llama3_tokenizer, path: /m/tokenizer.model}'"
        ),
    )
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the --tokenizer config, repeatable (e.g. --set model_dir=/models/llama3)")
    p.add_argument("--special-tokens-path", default=None, help="special tokens tokenizer.json for a tokenizer.model path")
    # default=SUPPRESS: the formatter would append "(default: None)" to the real default below.
    p.add_argument("--max-seq-len", type=int, default=argparse.SUPPRESS,
                   help="length above which a row counts as truncated (default: the tokenizer's max_seq_len)")
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
        int: 0 on success, 2 on bad input (unknown dataset, missing file, bad row). A dataset
        that fails is reported on stderr (and as "failed" in --json, a last line of the
        Markdown table); the datasets that finished are still in the report.
    """
    try:
        specs: List[Dict[str, Any]] = [parse_dataset_arg(v, split=args.split) for v in args.dataset]
        tokenizer = _tokenizer_arg(args.tokenizer, args.sets)
    except (argparse.ArgumentTypeError, ValueError, OSError) as e:
        print(f"hlmtune data-report: error: {e}", file=sys.stderr)
        return 2

    from hlmtune.data_builders.report import atomic_write_text, format_report, token_count_report, write_report_json

    failures: List[Dict[str, Any]] = []
    try:
        rows = token_count_report(
            datasets=specs,
            tokenizer=tokenizer,
            special_tokens_path=args.special_tokens_path,
            max_seq_len=getattr(args, "max_seq_len", None),  # absent when not given
            subset_size=args.subset_size,
            subset_seed=args.subset_seed,
            on_bad_row=args.on_bad_row,
            progress=not args.no_progress,
            failures=failures,  # a dataset that fails does not cost the ones already counted
        )
    except (ValueError, OSError) as e:  # the tokenizer itself
        print(f"hlmtune data-report: error: {e}", file=sys.stderr)
        return 2
    failed = [
        {"dataset": str(f["dataset"]), "error": _error_line(f["error"], str(f["dataset"]), args.subset_size)}
        for f in failures
    ]
    table = format_report(rows, args.format)
    if failed and args.format == "markdown":
        # The table holds only the datasets that finished: say so in it, not only on stderr.
        # No dataset finished: the failures replace the table (no empty header).
        table = (table + "\n" if rows else "") + "Incomplete: " + "; ".join(
            f"{f['dataset']} failed ({f['error']})" for f in failed) + "\n"
    if args.output:
        atomic_write_text(args.output, table)
    else:
        sys.stdout.write(table)
    if args.json_path:
        write_report_json(rows, args.json_path, failed)
    for f in failed:
        print(f"hlmtune data-report: error: {f['dataset']}: {f['error']}", file=sys.stderr)
    return 2 if failed else 0


def _error_line(e: BaseException, dataset: str, subset_size: Optional[int] = None) -> str:
    """The message of a dataset's error, with the hint a command-line user can act on.

    Args:
        e (BaseException): the dataset's error.
        dataset (str): the dataset name, printed before the message by the caller: a leading
            ``"<dataset>: "`` of the message (builders add it) is dropped so it shows once.
        subset_size (Optional[int]): ``--subset-size``: rows are then checked in a seeded
            random order, so the bad row named need not be the file's first; the message says so.

    Returns:
        str: one line.
    """
    skippable = getattr(e, "skippable", False)
    message = e.problem if skippable else str(e)  # BadRowError: name the flag, not the config key
    if message.startswith(f"{dataset}: "):
        message = message[len(dataset) + 2:]
    if skippable and subset_size is not None:
        # Row and line number the whole file, not the subset (a 1946 with --subset-size 5 is right).
        message += (
            " ('row' counts all rows of the file from 0, 'line' is the file's 1-based line; "
            f"--subset-size {subset_size} checks rows in a seeded random order, so this need not be "
            "the file's first bad row)"
        )
    if skippable:
        message += " (rerun with --on-bad-row skip to skip and count bad rows)"
    return message


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``data-report`` standalone (``python -m hlmtune.data_builders.cli``)."""
    parser = argparse.ArgumentParser(prog="hlmtune")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data-report", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
