"""From expanded tasks to a sweep directory: one config per task, validated; the manifest.

Each task's config is the base config with the grid's and the axis values' overrides,
``output_dir`` set to the task's run directory and the metric logger wrapped by the
profiling collector (``<run>/metrics/``: ``run.json``, ``steps.jsonl``, ``summary.json``).
It is written to ``<run>/config.yaml`` (interpolations such as ``${oc.env:HLM_DATA}`` kept,
so they resolve on the compute node) and validated the way ``hlmtune validate`` does it:
``load_config`` then ``validate_config`` against the recipe's spec. Nothing is written
before every task has passed.

Sweep directory::

    runs/<sweep>/manifest.json        tasks: id, name, axes, command, resources, run dir
    runs/<sweep>/<sweep>.sbatch       the array script(s), one per resource group
    runs/<sweep>/collect.sbatch       the dependent `hlmtune collect` job
    runs/<sweep>/grid.yaml            the grid as expanded
    runs/<sweep>/logs/%A_%a.out       SLURM output (linked from each run directory)
    runs/<sweep>/<id>-<name>/         config.yaml, metrics/, task_events.jsonl, checkpoints ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from hlmtune.sweep.grid import Grid, GridError, Task

MANIFEST = "manifest.json"
SUBMISSIONS = "submissions.json"
MANIFEST_SCHEMA = "hlmtune.sweep/1"
COLLECTOR = "hlmtune.profiling.collector.CollectorLogger"
METRICS_DIR = "metrics"
SUMMARY = "summary.json"
EVENTS = "task_events.jsonl"


class SweepError(ValueError):
    """A user error found before anything is submitted (printed as one line, exit status 2)."""


@dataclass
class Plan:
    """Everything a sweep writes, built in memory first.

    Attributes:
        grid (Grid): the grid.
        tasks (List[Task]): the tasks.
        sweep_dir (Path): ``<runs_dir>/<name>`` (absolute).
        manifest (Dict[str, Any]): the manifest (``tasks``, ``groups``...).
        configs (Dict[int, str]): task id -> config YAML text.
        scripts (Dict[str, str]): file name -> rendered script (filled by ``render``).
        warnings (List[str]): printed before submitting.
    """

    grid: Grid
    tasks: List[Task]
    sweep_dir: Path
    manifest: Dict[str, Any]
    configs: Dict[int, str]
    scripts: Dict[str, str] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)


def sweep_dir_for(grid: Grid, runs_dir: Optional[str]) -> Path:
    """``<runs_dir>/<name>``: ``--runs-dir``, else the grid's ``runs_dir``, else ``runs`` (cwd-relative)."""
    base = Path(runs_dir or grid.runs_dir or "runs")
    return (base / grid.name).resolve()


def hlmtune_command(grid: Grid) -> List[str]:
    """How tasks call hlmtune: ``environment.hlmtune``, else this installation's entry point.

    Inside a container the container's own ``hlmtune`` is used (host paths may not exist there).
    """
    import shlex

    if grid.environment.hlmtune:
        return shlex.split(grid.environment.hlmtune)
    if grid.container is not None:
        return ["hlmtune"]
    script = Path(sys.executable).with_name("hlmtune")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hlmtune.cli"]


def resolve_config_for(grid: Grid, name: str, where: str) -> Path:
    """A pack config name, a path relative to the grid file, or a path relative to the cwd."""
    from hlmtune.registry import config_path, resolve_config

    p = config_path(name)
    if p is not None:
        return p
    rel = grid.path.parent / name
    if rel.is_file():
        return rel.resolve()
    try:
        return resolve_config(name)
    except FileNotFoundError as e:
        raise SweepError(f"{grid.path}: {where}: {e}") from None


@contextmanager
def _env(vars_: Dict[str, str]) -> Iterator[None]:
    """The grid's environment.vars set while configs are resolved (as on the compute node)."""
    old = {k: os.environ.get(k) for k in vars_}
    os.environ.update(vars_)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def task_config(grid: Grid, task: Task, cfg_path: Path, run_dir: Path):
    """The config a task runs: base + overrides + run directory + collector.

    Args:
        grid (Grid): the grid.
        task (Task): the task.
        cfg_path (Path): resolved base config.
        run_dir (Path): the task's run directory.

    Returns:
        DictConfig: unresolved config.
    """
    from omegaconf import OmegaConf

    from hlmtune.compat import load_config

    cfg = load_config(str(cfg_path), [])
    for key in task.unset:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if node is None or leaf not in node:
            raise SweepError(f"{grid.path}: {task.describe()}: unset '{key}': no such key in {cfg_path.name}")
        node.pop(leaf)
    for key, value in task.set.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    if grid.requeue.enabled and grid.requeue.save_every_n_steps is not None:
        OmegaConf.update(cfg, "save_every_n_steps", grid.requeue.save_every_n_steps, force_add=True)
    cfg.output_dir = str(run_dir)
    logger = cfg.get("metric_logger")
    logger_c = OmegaConf.to_container(logger, resolve=False) if logger is not None else None
    if isinstance(logger_c, dict) and logger_c.get("_component_") == COLLECTOR:
        logger_c["log_dir"] = str(run_dir / METRICS_DIR)
        new = logger_c
    else:
        # The collector wraps the config's own logger, so what it logged still gets logged.
        new = {"_component_": COLLECTOR, "log_dir": str(run_dir / METRICS_DIR), "run_name": task.dir_name,
               "wrapped": logger_c}
    cfg.metric_logger = OmegaConf.create(new)
    return cfg


def _recipe_for(grid: Grid, task: Task, cfg_path: Path) -> str:
    from hlmtune.registry import recipe_for_config, recipe_in_header

    # A copy of a pack config (`hlmtune cp ecg_lora my_ecg.yaml`) keeps the header's launch
    # command, so it names its recipe as `hlmtune validate` reads it.
    recipe = (task.recipe or recipe_for_config(task.config) or recipe_for_config(cfg_path.name)
              or recipe_in_header(cfg_path))
    if recipe is None:
        raise SweepError(f"{grid.path}: {task.describe()}: config {task.config} is not a pack config and its "
                         "header names no `hlmtune run <recipe>`: name its recipe with `recipe:` (top level or "
                         "per axis value)")
    if recipe.endswith(".py") and not Path(recipe).is_absolute() and (grid.path.parent / recipe).is_file():
        recipe = str((grid.path.parent / recipe).resolve())
    return recipe


def validate_task(grid: Grid, task: Task, cfg, recipe: str, *, check_paths: bool) -> List[str]:
    """Validate one task's config as ``hlmtune validate`` does; returns warnings.

    Raises:
        SweepError: naming the task (its axis values) and every problem.
    """
    from hlmtune.launch import PreLaunchError
    from hlmtune.preflight import env_problems, preflight
    from hlmtune.registry import resolve_recipe
    from hlmtune.training.schema import ConfigError, config_warnings, validate_config

    head = f"{grid.path}: {task.describe()}: {task.config}"
    warnings: List[str] = []
    try:
        resolved = resolve_recipe(recipe)
    except ValueError as e:
        raise SweepError(f"{head}: {e}") from None
    with _env(grid.environment.vars):
        env = env_problems(cfg)
        if env:
            if not grid.environment.setup:
                raise SweepError(f"{head}: " + "; ".join(env) + " (or set it in the grid's environment.vars)")
            warnings.append(f"{task.describe()}: " + "; ".join(env) + " (assumed set by environment.setup)")
            return warnings  # the config cannot be resolved here: the compute node checks it
        try:
            if resolved.spec is None:
                warnings.append(f"{task.describe()}: recipe {recipe} declares no RecipeSpec: config keys not validated")
            else:
                validate_config(cfg, resolved.spec)
                warnings.extend(f"{task.describe()}: {w}" for w in config_warnings(cfg, resolved.spec))
            if check_paths:
                problems = preflight(cfg)
                if problems:
                    raise PreLaunchError(problems)
        except (ConfigError, PreLaunchError) as e:
            raise SweepError(f"{head}: invalid config:\n  - " + "\n  - ".join(e.problems)) from None
        except ValueError as e:
            raise SweepError(f"{head}: {e}") from None
        device = str(cfg.get("device", "cuda"))
    if device.startswith("cuda") and not grid.node.gpus:
        raise SweepError(f"{head}: the config runs on device={device} but node.gpus is 0 (set node.gpus, or device: cpu)")
    if device == "cpu" and grid.node.gpus:
        raise SweepError(f"{head}: the config runs on device=cpu but would request {task.slurm['gpus']} GPU(s) "
                         "(node.gpus > 0): set device: cuda, or node.gpus: 0 for CPU runs")
    return warnings


def _launch_args(task: Task, multi_node: bool) -> List[str]:
    """torchrun flags of a single-node task (multi-node ones are added by the template)."""
    if multi_node:
        return []
    n = task.slurm["devices"]
    return ["--nproc_per_node", str(n)] if n > 1 else []


def template_for(grid: Grid, task: Task) -> str:
    """``single_node`` or ``multi_node`` (``slurm.template``; auto: by the task's node count)."""
    t = grid.slurm.get("template") or "auto"
    if t == "auto":
        return "multi_node" if task.slurm["nodes"] > 1 else "single_node"
    if t == "single_node" and task.slurm["nodes"] > 1:
        raise SweepError(f"{grid.path}: {task.describe()}: nodes={task.slurm['nodes']} needs the multi_node template "
                         "(slurm.template: single_node)")
    return t


def build_plan(grid: Grid, tasks: List[Task], sweep_dir: Path, *, check_paths: bool = False, progress: bool = True) -> Plan:
    """Per-task configs (validated), commands and resource groups; nothing written.

    Args:
        grid (Grid): the grid.
        tasks (List[Task]): from :func:`hlmtune.sweep.grid.expand`.
        sweep_dir (Path): absolute sweep directory.
        check_paths (bool): also check every input path the configs name (as ``hlmtune run`` will).
        progress (bool): a progress bar on stderr.

    Returns:
        Plan: manifest and config texts.

    Raises:
        SweepError: the first task that fails validation (names its axis values).
    """
    from omegaconf import OmegaConf
    from tqdm import tqdm

    hl = hlmtune_command(grid)
    configs: Dict[int, str] = {}
    rows: List[Dict[str, Any]] = []
    groups: Dict[str, Dict[str, Any]] = {}
    warnings: List[str] = []
    bar = tqdm(tasks, desc="validating task configs", unit="task", file=sys.stderr, disable=not progress or len(tasks) < 4)
    for task in bar:
        run_dir = sweep_dir / task.dir_name
        cfg_path = resolve_config_for(grid, task.config, f"{task.describe()}: config")
        recipe = _recipe_for(grid, task, cfg_path)
        try:
            cfg = task_config(grid, task, cfg_path, run_dir)
        except (ValueError, KeyError) as e:
            if isinstance(e, SweepError):
                raise
            raise SweepError(f"{grid.path}: {task.describe()}: {cfg_path}: {e}") from None
        warnings.extend(validate_task(grid, task, cfg, recipe, check_paths=check_paths))
        if grid.requeue.enabled and cfg.get("save_every_n_steps") is None:
            warnings.append(f"{task.describe()}: requeue is on but save_every_n_steps is null: a requeued run restarts "
                            "from scratch (set requeue.save_every_n_steps)")
        configs[task.id] = f"# hlmtune sweep {grid.name}, {task.describe()}; base config {cfg_path}\n" + OmegaConf.to_yaml(cfg)
        template = template_for(grid, task)
        gkey = json.dumps([template, {k: task.slurm[k] for k in sorted(task.slurm)}], sort_keys=True)
        group = groups.setdefault(gkey, {"template": template, "slurm": dict(task.slurm), "tasks": []})
        group["tasks"].append(task.id)
        config_file = run_dir / "config.yaml"
        argv = [*hl, "run", *_launch_args(task, template == "multi_node"), recipe, "--config", str(config_file)]
        rows.append({
            "id": task.id, "name": task.name, "dir": task.dir_name, "run_dir": str(run_dir),
            "axes": task.axes, "recipe": recipe, "base_config": str(cfg_path), "config_file": str(config_file),
            "set": task.set, "unset": task.unset, "slurm": task.slurm, "template": template, "argv": argv,
        })
    bar.close()
    for gi, g in enumerate(groups.values()):
        g["id"] = gi
        g["script"] = f"{grid.name}.sbatch" if len(groups) == 1 else f"{grid.name}.g{gi}.sbatch"
        for tid in g["tasks"]:
            rows[tid]["group"] = gi
    grid_text = grid.path.read_text(encoding="utf-8")
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "name": grid.name,
        "created": datetime.now(timezone.utc).isoformat(),
        "grid": str(grid.path),
        "grid_sha256": hashlib.sha256(grid_text.encode()).hexdigest(),
        "sweep_dir": str(sweep_dir),
        "workdir": str(Path.cwd()),
        "hlmtune": hl,
        "node": dataclasses.asdict(grid.node),
        "container": None if grid.container is None else dataclasses.asdict(grid.container),
        "requeue": dataclasses.asdict(grid.requeue),
        "groups": list(groups.values()),
        "tasks": rows,
    }
    return Plan(grid=grid, tasks=tasks, sweep_dir=sweep_dir, manifest=manifest, configs=configs, warnings=warnings)


# ------------------------------------------------------------ sweep directory
def read_manifest(sweep_dir: Path) -> Dict[str, Any]:
    """The manifest of an existing sweep directory.

    Raises:
        SweepError: no manifest, or not a sweep manifest.
    """
    p = Path(sweep_dir) / MANIFEST
    if not p.exists():
        raise SweepError(f"{sweep_dir}: not a sweep directory (no {MANIFEST}; create one with `hlmtune sweep GRID.yaml`)")
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise SweepError(f"{p}: not valid JSON ({e})") from None
    if m.get("schema") != MANIFEST_SCHEMA:
        raise SweepError(f"{p}: schema {m.get('schema')!r}, expected {MANIFEST_SCHEMA!r}")
    return m


def run_complete(run_dir: Path) -> bool:
    """A run is complete when the collector's ``close()`` wrote ``metrics/summary.json`` with ``complete: true``."""
    p = Path(run_dir) / METRICS_DIR / SUMMARY
    try:
        return bool(json.loads(p.read_text(encoding="utf-8")).get("complete"))
    except (OSError, ValueError):
        return False


def _identity(row: Dict[str, Any]) -> Dict[str, Any]:
    """What makes a task the same task across re-expansions (resources may change)."""
    return {k: row[k] for k in ("id", "name", "axes", "recipe", "base_config", "set", "unset")}


def check_reuse(plan: Plan, resume: bool) -> Optional[Dict[str, Any]]:
    """Refuse to reuse a sweep directory unless resuming the same grid.

    Args:
        plan (Plan): the new plan.
        resume (bool): ``--resume`` was given.

    Returns:
        Optional[Dict[str, Any]]: the old manifest when resuming, else None.

    Raises:
        SweepError: the directory holds a sweep and ``--resume`` is absent, or it holds a
            different grid's tasks.
    """
    d = plan.sweep_dir
    if not (d / MANIFEST).exists():
        if resume:
            raise SweepError(f"{d}: nothing to resume (no {MANIFEST}); run without --resume to create the sweep")
        if d.exists() and any(d.iterdir()):
            raise SweepError(f"{d} exists and is not empty: choose another `name:` or --runs-dir")
        return None
    old = read_manifest(d)
    done = sum(run_complete(Path(t["run_dir"])) for t in old["tasks"])
    if not resume:
        state = "finished" if done == len(old["tasks"]) else f"{done}/{len(old['tasks'])} tasks complete"
        raise SweepError(f"{d}: sweep '{old['name']}' already exists ({state}): a new sweep needs another `name:` "
                         "(or --runs-dir); to finish this one use --resume")
    new_ids = [_identity(r) for r in plan.manifest["tasks"]]
    old_ids = [_identity(r) for r in old["tasks"]]
    if new_ids != old_ids:
        diff = next((i for i, (a, b) in enumerate(zip(new_ids, old_ids)) if a != b), min(len(new_ids), len(old_ids)))
        raise SweepError(f"{d}: the grid's tasks changed since the sweep was created (first difference at task {diff}); "
                         "--resume needs the same tasks (resources may change): use a new `name:`")
    return old


def write_plan(plan: Plan, *, resume: bool) -> None:
    """Write configs, scripts, grid copy and manifest (atomically each; configs of complete runs untouched).

    Args:
        plan (Plan): a rendered plan.
        resume (bool): resuming: complete runs keep their files.
    """
    from hlmtune.files import atomic_write_text

    d = plan.sweep_dir
    (d / "logs").mkdir(parents=True, exist_ok=True)
    for row in plan.manifest["tasks"]:
        run_dir = Path(row["run_dir"])
        if resume and run_complete(run_dir):
            continue  # a completed run is never overwritten
        atomic_write_text(run_dir / "config.yaml", plan.configs[row["id"]])
    for name, text in plan.scripts.items():
        atomic_write_text(d / name, text)
        os.chmod(d / name, 0o755)
    shutil.copyfile(plan.grid.path, d / ".grid.yaml.tmp")
    os.replace(d / ".grid.yaml.tmp", d / "grid.yaml")
    # The manifest last: a sweep directory with a manifest has everything it lists.
    atomic_write_text(d / MANIFEST, json.dumps(plan.manifest, indent=2) + "\n")


def load_submissions(sweep_dir: Path) -> List[Dict[str, Any]]:
    """Past submissions (array job ids with their task ids), oldest first."""
    p = Path(sweep_dir) / SUBMISSIONS
    if not p.exists():
        return []
    try:
        return list(json.loads(p.read_text(encoding="utf-8")))
    except ValueError as e:
        raise SweepError(f"{p}: not valid JSON ({e})") from None


def record_submission(sweep_dir: Path, entry: Dict[str, Any]) -> None:
    """Append one submission to ``submissions.json`` (atomic rewrite)."""
    from hlmtune.files import atomic_write_text

    subs = load_submissions(sweep_dir) + [entry]
    atomic_write_text(Path(sweep_dir) / SUBMISSIONS, json.dumps(subs, indent=2) + "\n")


__all__ = ["GridError", "Plan", "SweepError", "build_plan", "check_reuse", "read_manifest", "run_complete", "write_plan"]
