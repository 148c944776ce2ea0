"""``hlmtune collect`` and ``hlmtune profile {nsys,torch,parse}`` (registration only: no torch here)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hlmtune.helpformat import DefaultsHelpFormatter


def _collect(args: argparse.Namespace) -> int:
    from hlmtune.profiling.analysis import main_collect

    return main_collect(args)


def _profile_nsys(args: argparse.Namespace) -> int:
    from hlmtune.profiling.nsys import run_nsys

    return run_nsys(args)


def _profile_torch(args: argparse.Namespace) -> int:
    from hlmtune.profiling.torchprof import run_torch

    return run_torch(args)


def _profile_parse(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hlmtune.profiling.nsys import NsysFormatError, summarize_path
    from hlmtune.profiling.runs import API_SUMMARY_FILE, atomic_write_json

    try:
        summary = summarize_path(args.paths)
    except (NsysFormatError, OSError) as e:
        print(f"hlmtune profile parse: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    atomic_write_json(out / API_SUMMARY_FILE, summary)
    for rank, body in summary["ranks"].items():
        print(f"rank {rank}:")
        for r in body["headline"]:
            share = "" if r["share"] is None else f"{100 * r['share']:.2f}%"
            print(f"  {r['category']:<10} {r['name']:<22} {r['seconds'] or 0:.6f} s {share:>8} calls={r['calls']}")
    print(f"wrote {out / API_SUMMARY_FILE}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``collect`` and ``profile`` to the ``hlmtune`` command line.

    Args:
        subparsers: the ``add_subparsers()`` object of the top-level parser.
    """
    fmt = DefaultsHelpFormatter
    c = subparsers.add_parser(
        "collect",
        help="scaling table (CSV/Markdown), problems and plots from collector run directories",
        description=(
            "Read run directories written by hlmtune.profiling.collector.CollectorLogger and write "
            "table.csv, table.md, problems.md/json, api_table.* (when profiles exist) and PNG plots. "
            "speedup = T1/TN, efficiency = speedup/N, overhead = TN - T1/N with T = total_time_s "
            "(training-loop time of the run; same work required). Exit status 1 when a run is lost (unreadable run.json/summary.json; "
            "the others are tabled), 2 when no run is usable; nothing is written when no run directory is found."
        ),
        formatter_class=fmt,
    )
    c.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, or parents searched for run.json/steps.jsonl")
    c.add_argument("--out", required=True, help="output directory")
    c.add_argument("--warmup-steps", type=int, default=None, help="override each run's warmup_steps (default: the run's own)")
    c.add_argument("--include-partial", action="store_true", help="keep partial (killed) runs as table rows, never used for scaling")
    c.add_argument("--work-tolerance", type=float, default=0.01,
                   help="relative difference in tokens/samples above which an N-device run is 'mismatched' with its 1-device baseline")
    c.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    c.set_defaults(func=_collect)

    p = subparsers.add_parser("profile", help="CUDA API summaries (nsys) or CPU torch.profiler summaries of a run",
                              description="Profile a training command and summarize CUDA API / kernel / memcpy / collective time.")
    ps = p.add_subparsers(dest="profile_command", metavar="<tool>")
    ps.required = True
    n = ps.add_parser(
        "nsys",
        help="run a command under Nsight Systems (CUDA + NVTX) and parse nsys stats",
        description=(
            "Runs `nsys profile --trace=cuda,nvtx,osrt ... <cmd>`, then `nsys stats --report "
            "cuda_api_sum,cuda_gpu_kern_sum,cuda_gpu_mem_time_sum,cuda_gpu_mem_size_sum --format csv`, "
            "and writes OUT/api_summary.json. Point --out at the run's collector log_dir so "
            "`hlmtune collect` puts the numbers in its table. Example: hlmtune profile nsys --window-s 720 "
            "--out runs/r1/metrics -- hlmtune run lora_finetune_distributed --config X"
        ),
        formatter_class=fmt,
    )
    n.add_argument("--out", default="nsys_profile", help="folder for the report, stats CSVs and api_summary.json")
    n.add_argument("--window-s", type=float, default=None, help="collection duration in seconds (nsys --duration); the papers used 720")
    n.add_argument("--delay-s", type=float, default=None, help="seconds before collection starts (nsys --delay)")
    n.add_argument("--trace", default="cuda,nvtx,osrt", help="nsys --trace APIs")
    n.add_argument("--stop-app", action="store_true",
                   help="with --window-s: let nsys terminate the command when the window ends (default: --kill none, it runs to the end)")
    n.add_argument("--dry-run", action="store_true", help="print the nsys profile and nsys stats commands and exit")
    n.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the training command")
    n.set_defaults(func=_profile_nsys)

    t = ps.add_parser(
        "torch",
        help="run a command with torch.profiler (CPU) in every process; same table shape as nsys",
        description=(
            "Every Python process started by the command profiles itself with torch.profiler (CPU) and "
            "writes OUT/torch_prof/rank<R>.json at exit; they are merged into OUT/api_summary.json "
            "(recipe ranges data/forward/backward/optimizer_step, DataLoader, gloo collectives, top ops)."
        ),
        formatter_class=fmt,
    )
    t.add_argument("--out", default="torch_profile", help="output folder")
    t.add_argument("--window-s", type=float, default=None, help="stop profiling after this many seconds (checked at module forwards)")
    t.add_argument("--top", type=int, default=15, help="operators kept per rank")
    t.add_argument("--shapes", type=int, default=0, metavar="N",
                   help="also record input shapes and keep the top N (operator, shapes) rows per rank "
                        "(cpu_op_shape; slower profiling; default 0: off)")
    t.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the training command")
    t.set_defaults(func=_profile_torch)

    r = ps.add_parser("parse", help="summarize existing nsys outputs (stats CSVs and/or SQLite exports)",
                      description="Parse `nsys stats --format csv` reports or `nsys export --type sqlite` files "
                                  "(files or folders) into OUT/api_summary.json.",
                      formatter_class=fmt)
    r.add_argument("paths", nargs="+", help="CSV / .sqlite files or folders holding them")
    r.add_argument("--out", required=True, help="folder for api_summary.json (e.g. the run's log_dir)")
    r.set_defaults(func=_profile_parse)
