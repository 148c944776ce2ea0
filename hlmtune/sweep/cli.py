"""``hlmtune sweep GRID.yaml`` and ``hlmtune sweep status SWEEP_DIR`` (registration: nothing heavy here)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

_USAGE = (
    "hlmtune sweep GRID.yaml [--dry-run | --submit | --local] [--resume] [--container IMAGE.sif]\n"
    "                     [--max-concurrent K] [--runs-dir DIR] [--check-paths] [--no-collect]\n"
    "       hlmtune sweep status SWEEP_DIR [--write DIR] [--json] [--no-slurm]"
)


def register(subparsers: Any) -> None:
    """Add ``sweep`` to the ``hlmtune`` command line.

    Args:
        subparsers: the ``add_subparsers()`` object of the top-level parser.
    """
    p = subparsers.add_parser(
        "sweep",
        help="expand a grid of experiments into SLURM job arrays (submit, resume, status, or run locally)",
        usage=_USAGE,
        description=(
            "Expand GRID.yaml (base config + axes + zip lists + per-value overrides; docs/sweep.md) into "
            "runs/<name>/ under the current directory: manifest.json, one validated config.yaml per task, and plain sbatch scripts (one job "
            "array per resource group, plus collect.sbatch). Without a mode flag the sweep directory is written "
            "and the sbatch commands to submit it by hand are printed. Every config is validated and every "
            "task checked against the node's size before anything is written or submitted. GRID.yaml is a file, "
            "or the name of a grid shipped with the pack (`hlmtune ls` lists them; a file of that name wins)."
        ),
        epilog=(
            "examples:\n"
            "  hlmtune sweep ecg_paper_sweep --dry-run     # a shipped grid by name: manifest + scripts\n"
            "  hlmtune cp ecg_paper_sweep.yaml my_sweep.yaml && hlmtune sweep my_sweep.yaml --dry-run\n"
            "  hlmtune sweep my_sweep.yaml --submit --max-concurrent 4\n"
            "  hlmtune sweep status runs/ecg_paper\n"
            "  hlmtune sweep my_sweep.yaml --resume         # resubmit only tasks without a complete run\n"
            "  hlmtune sweep tiny_cpu_sweep.yaml --local   # no SLURM: one task after another here\n"
            "                                              # (needs the tiny model and $HLM_DATA: see the grid's header)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("grid", metavar="GRID.yaml", help="the grid file or a shipped grid's name (`hlmtune ls`), or `status` followed by a sweep directory")
    p.add_argument("sweep_dir", nargs="?", metavar="SWEEP_DIR", help=argparse.SUPPRESS)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the manifest and the scripts; write and submit nothing")
    mode.add_argument("--submit", action="store_true",
                      help="write the sweep, then sbatch each array with --array=...%%K and collect.sbatch with "
                           "--dependency=afterany on them")
    mode.add_argument("--local", action="store_true", help="write the sweep, then run its tasks here one after another (no SLURM)")
    p.add_argument("--resume", action="store_true",
                   help="finish an existing sweep of the same grid: rerun only tasks without a complete run summary "
                        "that are not pending or running (submits, or runs them here with --local)")
    p.add_argument("--container", metavar="IMAGE.sif", default=None,
                   help="run every task inside this Apptainer/Singularity image (with --nv on GPU nodes); "
                        "overrides the grid's container.image")
    p.add_argument("--max-concurrent", metavar="K", type=int, default=None,
                   help="at most K tasks of each array run at once (%%K; default: the grid's slurm.max_concurrent, "
                        "else no limit)")
    p.add_argument("--runs-dir", metavar="DIR", default=None,
                   help="parent of the sweep directory (default: the grid's runs_dir, else ./runs)")
    p.add_argument("--check-paths", action="store_true",
                   help="also check every input path the configs name (checkpoints, tokenizer, data) exists here")
    p.add_argument("--no-collect", action="store_true", help="with --submit: do not submit the dependent collect job; with --local: do not write report/ after the tasks")
    p.add_argument("--write", metavar="DIR", default=None, help="status: also write tasks.csv / tasks.md to DIR")
    p.add_argument("--json", action="store_true", help="status: print the rows as JSON")
    p.add_argument("--no-slurm", action="store_true", help="status: read the run directories only (no squeue/sacct)")
    p.set_defaults(func=_cmd_sweep)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from hlmtune.sweep.grid import GridError
    from hlmtune.sweep.prepare import SweepError

    try:
        if args.grid == "status":
            if not args.sweep_dir:
                raise SweepError("usage: hlmtune sweep status SWEEP_DIR")
            return _status(args)
        if args.sweep_dir:
            raise SweepError(f"unexpected argument {args.sweep_dir!r} (one grid file per sweep)")
        return _sweep(args)
    except (GridError, SweepError) as e:
        print(f"hlmtune sweep: {e}", file=sys.stderr)
        return 2


def _status(args: argparse.Namespace) -> int:
    from hlmtune.sweep.prepare import read_manifest
    from hlmtune.sweep.status import format_rows, summary_line, task_states, task_table, write_table

    d = Path(args.sweep_dir).resolve()
    manifest = read_manifest(d)
    rows = task_states(manifest, d, use_slurm=not args.no_slurm)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_rows(rows))
        print(summary_line(rows))
    if args.write:
        for f in write_table(task_table(manifest, rows), Path(args.write)):
            print(f"wrote {f}", file=sys.stderr)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from hlmtune.sweep.files import resolve_grid
    from hlmtune.sweep.grid import ContainerSpec, expand, load_grid
    from hlmtune.sweep.prepare import SweepError, build_plan, check_reuse, sweep_dir_for, write_plan
    from hlmtune.sweep.render import render_plan

    if args.max_concurrent is not None and args.max_concurrent < 1:
        raise SweepError(f"--max-concurrent {args.max_concurrent}: needs at least 1")
    grid = load_grid(resolve_grid(args.grid))
    if args.container:
        grid.container = dataclasses.replace(grid.container or ContainerSpec(image=args.container), image=args.container)
    tasks = expand(grid)
    sweep_dir = sweep_dir_for(grid, args.runs_dir)
    plan = build_plan(grid, tasks, sweep_dir, check_paths=args.check_paths)
    k = args.max_concurrent or grid.slurm.get("max_concurrent")
    render_plan(plan, k)
    check_reuse(plan, args.resume)
    for w in plan.warnings:
        print(f"hlmtune sweep: warning: {w}", file=sys.stderr)
    if args.dry_run:
        print(f"# manifest.json ({len(tasks)} tasks, {len(plan.manifest['groups'])} array(s)) -> {sweep_dir}")
        print(json.dumps(plan.manifest, indent=2))
        for name, text in plan.scripts.items():
            print(f"\n# ---- {sweep_dir / name}")
            print(text, end="")
        print(f"\n# dry run: nothing written or submitted ({len(tasks)} task configs validated)", file=sys.stderr)
        return 0
    write_plan(plan, resume=args.resume)
    print(f"sweep {grid.name}: {len(tasks)} task(s) in {len(plan.manifest['groups'])} array(s) -> {sweep_dir}")
    ids = [t.id for t in tasks]
    if args.resume:
        from hlmtune.sweep.status import incomplete

        ids = incomplete(plan.manifest, sweep_dir, use_slurm=not args.local)
        if not ids:
            print("nothing to resume: every task is complete, pending or running (hlmtune sweep status "
                  f"{sweep_dir})")
            return 0
        print(f"resuming {len(ids)} task(s): {', '.join(map(str, ids))}")
    if args.local:
        from hlmtune.sweep.local import run_local

        rc = run_local(plan.manifest, dataclasses.asdict(grid.environment), ids)
        if grid.collect.enabled and not args.no_collect:
            _collect_local(plan.manifest, sweep_dir)  # what the collect job does after the arrays
        return rc
    if args.submit or args.resume:
        from hlmtune.sweep.slurm import submit

        entry = submit(plan.manifest, sweep_dir, ids, k, collect=not args.no_collect and grid.collect.enabled)
        for a in entry["arrays"]:
            print(f"submitted array job {a['job_id']} (--array={a['array']})")
        if entry["collect_job_id"]:
            print(f"submitted collect job {entry['collect_job_id']} (afterany) -> {sweep_dir / 'report'}")
        print(f"follow it with: hlmtune sweep status {sweep_dir}")
        return 0
    print("submit by hand:")
    for g in plan.manifest["groups"]:
        print(f"  sbatch {sweep_dir / g['script']}")
    if grid.collect.enabled:
        print(f"  sbatch --dependency=afterany:<job ids> {sweep_dir / 'collect.sbatch'}")
    print(f"or: hlmtune sweep {args.grid} --resume   (submits the tasks not yet complete)")
    return 0


def _collect_local(manifest: Any, sweep_dir: Path) -> None:
    """``report/`` as the collect job writes it: ``hlmtune collect`` and the per-task table."""
    from hlmtune.profiling.analysis import collect
    from hlmtune.sweep.status import task_states, task_table, write_table

    report = sweep_dir / "report"
    res = collect([sweep_dir], report)
    write_table(task_table(manifest, task_states(manifest, sweep_dir, use_slurm=False)), report)
    for p in res["problems"]:
        print(f"problem: {p['path']}: {p['reason']}", file=sys.stderr)
    print(f"report: {report / 'report.md'} ({len(res['rows'])} row(s))")
