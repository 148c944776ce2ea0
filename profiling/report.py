"""``report.md`` of a ``hlmtune collect`` folder: how to read each table and figure, linked.

The folder a sweep's collect job writes (``runs/<name>/report/``) opens with this page, as a
``make demo`` folder opens with its report: one paragraph per figure, the scaling regimes the
rows hold, and links to the tables and images beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence

# Figure file -> how to read it (the regimes paragraph comes first).
FIGURE_GUIDE = {
    "speedup_efficiency_vs_devices.png": (
        "Speedup and efficiency against the number of devices, with the ideal lines (speedup = N, "
        "efficiency = 1). A series that did the same work on N devices as on one (strong scaling) "
        "shows T1/TN; a series whose devices each kept their batch (weak scaling) did N times the "
        "work, so its T is not comparable and it shows the steady tokens/s ratio instead, labelled "
        "`(tokens/s)`. Both axes start at 0: the gap to the ideal line reads in proportion."),
    "iteration_time_vs_devices.png": (
        "Mean optimizer-step time per dataset. Under weak scaling a flat line is ideal (each device "
        "does the same step); under strong scaling the step should shrink as 1/N. The axis starts at "
        "0, so a small difference looks small."),
    "peak_memory_vs_devices.png": (
        "The largest per-step peak memory of one rank (CUDA allocated on GPUs, resident set size on "
        "CPU), per method. Sharded training (FSDP) lowers it with more devices; replicated training "
        "(DDP, CPU) keeps it flat."),
    "overhead_vs_devices.png": (
        "Overhead TN - T1/N: the seconds an N-device run spends beyond a perfect split of the "
        "one-device time (communication, waiting, imbalance). Strong-scaling rows only: it needs "
        "equal work."),
    "template_method_bars.png": (
        "Mean step time per prompt template and method, at one device and at the largest device "
        "count: which combination costs what."),
    "api_share_stacked.png": (
        "Per run and rank, the share of the CUDA API / kernel / memory-copy time (or torch.profiler "
        "CPU time) taken by the headline calls."),
}


def _regimes(rows: List[Dict[str, Any]]) -> str:
    multi = [r for r in rows if isinstance(r.get("devices"), int) and r["devices"] > 1]
    timed = sum(1 for r in multi if r.get("speedup") is not None)
    tput = sum(1 for r in multi if r.get("speedup") is None and r.get("speedup_tput") is not None)
    none = len(multi) - timed - tput
    parts = [f"{timed} multi-device row(s) did the same work as their 1-device baseline (strong scaling: "
             "speedup = T1/TN)",
             f"{tput} did other work (weak scaling, or a step limit with the per-device batch kept: "
             "\"mismatched\" in problems.md; speedup by tokens/s)"]
    if none:
        parts.append(f"{none} have no 1-device baseline or are partial (no speedup)")
    return "; ".join(parts) + "."


def scaling_report_markdown(rows: List[Dict[str, Any]], problems: List[Dict[str, str]], files: Sequence[str | Path],
                            *, t_definition: str) -> str:
    """The report page of a collect folder.

    Args:
        rows (List[Dict[str, Any]]): the table's rows.
        problems (List[Dict[str, str]]): what was left out or is incomplete.
        files (Sequence[str | Path]): the files written beside it (only those are linked).
        t_definition (str): the paragraph defining T, speedup and efficiency.

    Returns:
        str: Markdown text.
    """
    names = {Path(f).name for f in files}
    runs = sum(r.get("n_runs", 0) for r in rows)
    out = ["# Scaling report", "",
           f"{len(rows)} row(s) from {runs} run(s); {len(problems)} problem(s) "
           f"([problems.md](problems.md): left out, partial or mismatched runs, each with the reason).", "",
           "## Tables", "",
           "- [table.md](table.md): the key figures per row (devices, steps, iteration time, tokens/s, peak "
           "memory, speedup, efficiency, overhead), then the other columns that have values;",
           "- [table.csv](table.csv): every column at full precision, with each row's run folders."]
    out.append("- in a sweep's report folder, `tasks.md` / `tasks.csv`: one row per task with its state and axes "
               "(written beside this page by `hlmtune sweep status --write`).")
    if "api_table.md" in names:
        out.append("- [api_table.md](api_table.md): the CUDA API / kernel summaries per run and rank.")
    out += ["", "## Strong and weak scaling", "", _regimes(rows), "", t_definition, "", "## Figures", ""]
    for name, guide in FIGURE_GUIDE.items():
        if name in names:
            out += [f"### {name}", "", guide, "", f"![{name}]({name})", ""]
    return "\n".join(out).rstrip("\n") + "\n"
