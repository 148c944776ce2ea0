"""Token-count report per dataset and template.

For each dataset spec the builder is run with ``train_on_input=False`` (so the loss mask splits
prompt from target) on an untruncated copy of the tokenizer, and every sample is measured:

- ``tokens``: sequence length with special tokens (BOS, headers, EOT, final EOS);
- ``prompt_tokens``: tokens masked out of the loss (BOS, system/user turns with their headers,
  the final EOS); ``target_tokens``: tokens in the loss (assistant turns with their headers
  and EOT). ``prompt_tokens + target_tokens == tokens``;
- ``truncated_rows``: samples longer than ``max_seq_len`` (the tokenizer's unless given),
  i.e. the ones the training tokenizer would cut.

Statistics: total, mean, median (``statistics.median``), p90 (nearest rank: the
``ceil(0.9 n)``-th smallest) and max. Preference datasets give one report row per side
(template ``chat (chosen)`` / ``chat (rejected)``); ``rows`` counts pairs.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import importlib
import io
import json
import math
import os
import statistics
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

from hlmtune.files import atomic_write_text
from hlmtune.data_builders.preference import TEMPLATE_NAMES as _PREF_TEMPLATES
from hlmtune.data_builders.preference import hh_rlhf_dataset, stack_exchange_paired_dataset
from hlmtune.data_builders.sft import TEMPLATE_NAMES as _SFT_TEMPLATES
from hlmtune.data_builders.sft import alpaca_cleaned_dataset, grammar_dataset, samsum_dataset, slimorca_dataset

# Registry: report/CLI name -> builder.
BUILDERS = {
    "alpaca_cleaned": alpaca_cleaned_dataset,
    "grammar": grammar_dataset,
    "samsum": samsum_dataset,
    "slimorca": slimorca_dataset,
    "stack_exchange_paired": stack_exchange_paired_dataset,
    "hh_rlhf": hh_rlhf_dataset,
}
TEMPLATES = {**_SFT_TEMPLATES, **_PREF_TEMPLATES}

# Report columns, in table order.
COLUMNS = (
    "dataset", "template", "source", "rows", "skipped_rows", "tokens_total", "tokens_mean",
    "tokens_median", "tokens_p90", "tokens_max", "prompt_tokens_total", "prompt_tokens_mean",
    "target_tokens_total", "target_tokens_mean", "max_seq_len", "truncated_rows",
)
_IGNORE = -100  # torchtune.data.CROSS_ENTROPY_IGNORE_IDX (imported lazily below, checked equal)


def nearest_rank(values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile: the ``ceil(q * n)``-th smallest value (q in (0, 1]).

    Args:
        values (Sequence[int]): non-empty values.
        q (float): quantile.

    Returns:
        int: the percentile.
    """
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize_lengths(
    lengths: Sequence[int], prompt: Sequence[int], target: Sequence[int], max_seq_len: Optional[int]
) -> Dict[str, Any]:
    """Statistics of one set of sequences.

    Args:
        lengths (Sequence[int]): tokens per sequence.
        prompt (Sequence[int]): prompt (loss-masked) tokens per sequence.
        target (Sequence[int]): target tokens per sequence.
        max_seq_len (Optional[int]): truncation length; None counts no truncation.

    Returns:
        Dict[str, Any]: the numeric report columns.
    """
    n = len(lengths)
    if n == 0:
        return {
            "rows": 0, "tokens_total": 0, "tokens_mean": 0.0, "tokens_median": 0.0, "tokens_p90": 0,
            "tokens_max": 0, "prompt_tokens_total": 0, "prompt_tokens_mean": 0.0,
            "target_tokens_total": 0, "target_tokens_mean": 0.0, "max_seq_len": max_seq_len,
            "truncated_rows": 0,
        }
    return {
        "rows": n,
        "tokens_total": int(sum(lengths)),
        "tokens_mean": sum(lengths) / n,
        "tokens_median": float(statistics.median(lengths)),
        "tokens_p90": int(nearest_rank(lengths, 0.9)),
        "tokens_max": int(max(lengths)),
        "prompt_tokens_total": int(sum(prompt)),
        "prompt_tokens_mean": sum(prompt) / n,
        "target_tokens_total": int(sum(target)),
        "target_tokens_mean": sum(target) / n,
        "max_seq_len": max_seq_len,
        "truncated_rows": 0 if max_seq_len is None else sum(1 for x in lengths if x > max_seq_len),
    }


def resolve_tokenizer(
    tokenizer: Any, *, special_tokens_path: Optional[str] = None, max_seq_len: Optional[int] = None
) -> Any:
    """A tokenizer object from an object, a ``_component_`` spec or a ``tokenizer.model`` path.

    Args:
        tokenizer (Any): a tokenizer (has ``tokenize_messages``); a mapping with
            ``_component_`` (e.g. ``{"_component_": "torchtune.models.llama3.llama3_tokenizer",
            "path": ...}``), instantiated with ``torchtune.config.instantiate``; or a path to a
            Llama3 ``tokenizer.model`` (``torchtune.models.llama3.llama3_tokenizer``).
        special_tokens_path (Optional[str]): for a path: the ``tokenizer.json`` of special tokens.
        max_seq_len (Optional[int]): for a path: the tokenizer's ``max_seq_len``.

    Returns:
        Any: the tokenizer.
    """
    if hasattr(tokenizer, "tokenize_messages"):
        return tokenizer
    if isinstance(tokenizer, Mapping):
        from omegaconf import OmegaConf
        from torchtune import config

        spec = dict(tokenizer)
        if "_component_" not in spec:
            raise ValueError(f"tokenizer spec needs a _component_ key, got keys {sorted(spec)}")
        return config.instantiate(OmegaConf.create(spec))
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        from torchtune.models.llama3 import llama3_tokenizer

        return llama3_tokenizer(path, special_tokens_path=special_tokens_path, max_seq_len=max_seq_len)
    raise TypeError(f"tokenizer must be a tokenizer, a _component_ mapping or a path, got {type(tokenizer).__name__}")


def _builder_for(spec: Mapping[str, Any]) -> tuple:
    """(name, builder) for a dataset spec with ``name`` or ``_component_``."""
    if "_component_" in spec:
        dotpath = spec["_component_"]
        module_name, _, attr = dotpath.rpartition(".")
        builder = getattr(importlib.import_module(module_name), attr)
        name = spec.get("name") or next((k for k, b in BUILDERS.items() if b is builder), attr)
        return name, builder
    name = spec.get("name")
    if name not in BUILDERS:
        import difflib

        close = difflib.get_close_matches(str(name), list(BUILDERS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown dataset {name!r}{hint} Known: {sorted(BUILDERS)}")
    return name, BUILDERS[name]


def _normalize_specs(datasets: Union[Sequence[Any], Mapping[str, Any]]) -> List[Dict[str, Any]]:
    if isinstance(datasets, Mapping):
        # {"samsum": {"source": "json", ...}, "grammar": None}
        return [{"name": k, **dict(v or {})} for k, v in datasets.items()]
    specs = []
    for item in datasets:
        specs.append({"name": item} if isinstance(item, str) else dict(item))
    return specs


def token_count_report(
    *,
    datasets: Union[Sequence[Any], Mapping[str, Any]],
    tokenizer: Any,
    special_tokens_path: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    subset_size: Optional[int] = None,
    subset_seed: int = 0,
    on_bad_row: Optional[str] = None,
    progress: bool = True,
    failures: Optional[List[Dict[str, Any]]] = None,
) -> List[Dict[str, Any]]:
    """Token counts per dataset and template.

    Args:
        datasets (Union[Sequence[Any], Mapping[str, Any]]): dataset specs: names
            ("samsum": hub source), dicts ``{"name": "samsum", "source": "json", "data_files":
            ..., <other builder kwargs>}`` or ``{"_component_": "hlmtune.data_builders.
            samsum_dataset", ...}`` (a recipe's ``dataset`` config), or a mapping name -> kwargs.
            An optional ``template`` key overrides the template label.
        tokenizer (Any): tokenizer object, ``_component_`` mapping or ``tokenizer.model`` path
            (see :func:`resolve_tokenizer`).
        special_tokens_path (Optional[str]): special tokens file for a tokenizer path.
        max_seq_len (Optional[int]): truncation length for ``truncated_rows``; default the
            tokenizer's ``max_seq_len`` (None: nothing counts as truncated).
        subset_size (Optional[int]): default ``subset_size`` for specs without one.
        subset_seed (int): default ``subset_seed`` for specs without one.
        on_bad_row (Optional[str]): default ``on_bad_row`` for specs without one.
        progress (bool): tqdm bar on stderr. Default True.
        failures (Optional[List[Dict[str, Any]]]): when given, a dataset that fails (bad row,
            missing file, bad spec) is appended here as ``{"dataset", "error"}`` (the
            exception) and the other datasets are still reported; when None it raises.

    Returns:
        List[Dict[str, Any]]: one dict per (dataset, template) with the keys of ``COLUMNS``.
    """
    from torchtune.data import CROSS_ENTROPY_IGNORE_IDX

    assert CROSS_ENTROPY_IGNORE_IDX == _IGNORE
    tok = resolve_tokenizer(tokenizer, special_tokens_path=special_tokens_path, max_seq_len=max_seq_len)
    limit = max_seq_len if max_seq_len is not None else getattr(tok, "max_seq_len", None)
    # Measure untruncated lengths: a shallow copy shares the BPE model, only max_seq_len differs.
    full = copy.copy(tok)
    if hasattr(full, "max_seq_len"):
        full.max_seq_len = None

    report: List[Dict[str, Any]] = []
    for spec in _normalize_specs(datasets):
        try:
            report.extend(_dataset_rows(spec, full, limit, subset_size, subset_seed, on_bad_row, progress))
        except (ValueError, OSError) as e:  # BadRowError is a ValueError
            if failures is None:
                raise
            failures.append({"dataset": spec.get("name") or spec.get("_component_"), "error": e})
    return report


@contextlib.contextmanager
def _datasets_bars(progress: bool) -> Iterator[None]:
    """Without ``progress``, the ``datasets`` library's own bars ("Generating train split") off
    while a dataset loads; restored on exit. (Its ``ERROR: Failed to load JSON`` record on a bad
    file is muted where the file is read: ``hlmtune.data_builders.loading``.)

    Args:
        progress (bool): keep the bars.
    """
    if progress:
        yield
        return
    from datasets.utils import logging as ds_logging

    bars = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            ds_logging.enable_progress_bar()


def _dataset_rows(
    spec: Dict[str, Any], full: Any, limit: Optional[int], subset_size: Optional[int], subset_seed: int,
    on_bad_row: Optional[str], progress: bool,
) -> List[Dict[str, Any]]:
    """Report rows of one dataset spec (see :func:`token_count_report`)."""
    from torchtune.datasets import PreferenceDataset
    from tqdm.auto import tqdm

    report: List[Dict[str, Any]] = []
    name, builder = _builder_for(spec)
    kwargs = {k: v for k, v in spec.items() if k not in ("name", "_component_", "template")}
    if subset_size is not None:
        kwargs.setdefault("subset_size", subset_size)
    kwargs.setdefault("subset_seed", subset_seed)
    if on_bad_row is not None:
        kwargs.setdefault("on_bad_row", on_bad_row)
    kwargs["train_on_input"] = False  # the mask must separate prompt from target
    kwargs["packed"] = False
    with _datasets_bars(progress):
        ds = builder(full, **kwargs)
    is_pref = isinstance(ds, PreferenceDataset)
    template = spec.get("template") or TEMPLATES.get(name, "custom")
    sides = ("chosen", "rejected") if is_pref else ("",)
    stats = {side: ([], [], []) for side in sides}
    for i in tqdm(range(len(ds)), desc=f"{name}: counting tokens", unit="row", disable=not progress):
        sample = ds[i]
        for side in sides:
            tokens = sample[f"{side}_input_ids"] if side else sample["tokens"]
            labels = sample[f"{side}_labels"] if side else sample["labels"]
            target = sum(1 for x in labels if x != _IGNORE)
            lengths, prompts, targets = stats[side]
            lengths.append(len(tokens))
            prompts.append(len(tokens) - target)
            targets.append(target)
    for side in sides:
        row = {
            "dataset": name,
            "template": f"{template} ({side})" if side else template,
            "source": ds.source_label,
            "skipped_rows": ds.skipped_rows,
        }
        row.update(summarize_lengths(*stats[side], limit))
        report.append({k: row[k] for k in COLUMNS})
    return report


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def format_report(rows: Iterable[Mapping[str, Any]], fmt: str = "markdown") -> str:
    """Render the report as a Markdown table or CSV.

    Args:
        rows (Iterable[Mapping[str, Any]]): :func:`token_count_report` output.
        fmt (str): "markdown" (default) or "csv" (full precision).

    Returns:
        str: the table.
    """
    rows = list(rows)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in COLUMNS})
        return buf.getvalue()
    if fmt != "markdown":
        raise ValueError(f"format must be 'markdown' or 'csv', got {fmt!r}")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k)) for k in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def write_report_json(
    rows: Sequence[Mapping[str, Any]], path: Union[str, os.PathLike], failed: Sequence[Mapping[str, str]] = ()
) -> None:
    """Write the report as JSON (``{"columns": [...], "rows": [...]}``), atomically.

    Args:
        rows (Sequence[Mapping[str, Any]]): :func:`token_count_report` output.
        path (Union[str, os.PathLike]): destination.
        failed (Sequence[Mapping[str, str]]): datasets left out (``{"dataset", "error"}``):
            written as ``"failed"`` so an incomplete report never looks complete.
    """
    body: Dict[str, Any] = {"columns": list(COLUMNS), "rows": list(rows)}
    if failed:
        body["failed"] = [dict(f) for f in failed]
    atomic_write_text(path, json.dumps(body, indent=2) + "\n")
