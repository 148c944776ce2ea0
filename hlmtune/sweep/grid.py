"""Grid files: schema checks and expansion into tasks (pure Python: no torch, no torchtune).

A grid is a YAML mapping (docs/sweep.md has the full schema)::

    name: ecg_paper                  # the sweep: runs/<name>/
    config: ecg_pretrain             # base config: pack name or YAML path (may use {axis})
    set: {max_steps_per_epoch: 200}  # overrides for every task
    node: {gpus: 4, cpus: 128}       # what one node has (checked before submit)
    slurm: {partition: gpu, time: "02:00:00", max_concurrent: 8}
    axes:
      window: {key: dataset.max_seq_len, values: [128, 256, 512, 1024]}
      devices: [1, 2, 4]             # a resource axis: devices (GPUs) per node
    zip:
      - {cpus_per_task: [8, 16], workers: {key: data_loader.num_workers, values: [7, 15]}}
    exclude:
      - {window: 1024, devices: 1}

Tasks are the product of the axes and zip groups (first axis slowest), minus ``exclude``.
Every error names the grid file and the key (with the closest known key for typos).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hlmtune.training.options import (
    REQUIRED,
    as_str_tuple,
    check_any,
    check_bool,
    check_choice,
    check_int_ge0,
    check_int_gt0,
    check_opt_bool,
    check_opt_int_gt0,
    check_str,
    check_str_list,
    closest,
    option,
    parse_section,
)

TOP_KEYS = (
    "name", "description", "config", "recipe", "set", "unset", "runs_dir", "node", "slurm",
    "requeue", "environment", "container", "collect", "templates", "axes", "zip", "exclude",
)
# Resources of one task: they may be axes, per-value overrides, or set once under `slurm:`.
TASK_SLURM_KEYS = (
    "nodes", "devices", "cpus_per_task", "mem", "time", "partition", "account", "qos",
    "constraint", "reservation", "gpu_request", "gpu_type", "extra",
)
# Settings of the whole array (only under the top-level `slurm:`).
ARRAY_SLURM_KEYS = ("max_concurrent", "template", "job_name")
SLURM_KEYS = TASK_SLURM_KEYS + ARRAY_SLURM_KEYS
COLLECT_SLURM_KEYS = ("partition", "account", "qos", "time", "mem", "cpus_per_task", "constraint", "reservation", "extra")
AXIS_KEYS = ("key", "label", "values")
VALUE_KEYS = ("value", "label", "set", "unset", "config", "recipe", "slurm")
# Axis names with a built-in meaning (besides the resource keys).
SPECIAL_AXES = ("recipe", "config")
TEMPLATES = ("auto", "single_node", "multi_node")
GPU_REQUESTS = ("gpus-per-node", "gres")
RUNTIMES = ("auto", "apptainer", "singularity")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_TIME = re.compile(r"^\d+(-\d+)?(:\d+){0,2}$")  # SLURM: min, min:s, h:m:s, d-h, d-h:m, d-h:m:s
_MEM = re.compile(r"^\d+[KMGT]?B?$", re.IGNORECASE)
# #SBATCH values: one word, no quotes (sbatch strips plain single quotes but not escaped ones).
_SBATCH_WORD = re.compile(r"^[A-Za-z0-9_.,:+|&*\[\]@/=%-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_BAD = re.compile(r"[^A-Za-z0-9._+-]+")


class GridError(ValueError):
    """A grid file problem; the message names the file and the key, axis or value."""


def _check_setup(v: Any) -> Optional[str]:
    return None if v is None or isinstance(v, str) else "must be shell lines as one string (use `setup: |`)"


def _check_env_vars(v: Any) -> Optional[str]:
    if v is None:
        return None
    if not isinstance(v, Mapping):
        return "must be a mapping NAME: value"
    for k, x in v.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            return f"must be a mapping NAME: value ({k!r} is not an environment variable name)"
        if isinstance(x, (Mapping, list)) or x is None:
            return f"must map each name to a scalar ({k}: {x!r})"
    return None


def _check_opt_name(v: Any) -> Optional[str]:
    return None if v is None else check_str(v)


# The grid's fixed sections, declared on the recipes' option machinery (training/options.py):
# each key's type, default, check and meaning in one place. `slurm:` is not among them: its
# keys are also axis names and per-value overrides, checked by check_slurm().
@dataclass(frozen=True)
class NodeSpec:
    """``node:`` what one node of the cluster has (each task is checked against it)."""

    gpus: int = option(0, check_int_ge0, "GPUs per node (0: CPU nodes; devices are CPU ranks)")
    cpus: Optional[int] = option(None, check_opt_int_gt0, "CPUs per node (null: not checked)")


@dataclass(frozen=True)
class RequeueSpec:
    """``requeue:`` resubmission at the time limit (the rerun resumes from its checkpoint)."""

    enabled: Optional[bool] = option(None, check_opt_bool, "requeue on the time-limit signal (default: on when "
                                     "the section is given)")
    signal_seconds: int = option(300, check_int_gt0, "seconds before the limit that SLURM signals the job")
    save_every_n_steps: Optional[int] = option(None, check_opt_int_gt0, "checkpoint interval forced on every task "
                                               "(null: the config's)")


@dataclass(frozen=True)
class EnvironmentSpec:
    """``environment:`` what every task runs in."""

    setup: str = option("", _check_setup, "shell lines run before each task (module load, conda activate)",
                        convert=lambda v: v or "")
    vars: Dict[str, str] = option({}, _check_env_vars, "environment variables of every task",
                                  convert=lambda v: {k: str(x) for k, x in (v or {}).items()})
    hlmtune: Optional[str] = option(None, _check_opt_name, "the command that runs hlmtune on the nodes "
                                    "(default: this installation's)")


@dataclass(frozen=True)
class ContainerSpec:
    """``container:`` an Apptainer/Singularity image every task runs in."""

    image: str = option(REQUIRED, check_str, "the image (.sif)")
    runtime: str = option("auto", check_choice(RUNTIMES), "apptainer, singularity, or auto (whichever is on PATH)")
    binds: Tuple[str, ...] = option((), check_str_list, "host paths bound into the container", convert=as_str_tuple)
    options: Tuple[str, ...] = option((), check_str_list, "more apptainer exec options", convert=as_str_tuple)


@dataclass(frozen=True)
class CollectSpec:
    """``collect:`` the job that gathers the runs' metrics when the arrays end."""

    enabled: bool = option(True, check_bool, "submit the collect job after the arrays (afterany)")
    slurm: Dict[str, Any] = option({}, check_any, f"its resources: {', '.join(COLLECT_SLURM_KEYS)} "
                                   "(partition, account, qos: the arrays' unless given)")


GRID_SECTIONS = {"node": NodeSpec, "requeue": RequeueSpec, "environment": EnvironmentSpec,
                 "container": ContainerSpec, "collect": CollectSpec}


@dataclass(frozen=True)
class AxisValue:
    """One value of an axis with what it changes.

    Attributes:
        value (Any): the value (assigned to the axis ``key`` when it has one).
        label (str): its part of task names (file-name safe).
        set (Dict[str, Any]): config overrides (dotted key -> value).
        unset (Tuple[str, ...]): config keys removed.
        config (Optional[str]): base config for tasks with this value (may use ``{axis}``).
        recipe (Optional[str]): recipe for tasks with this value.
        slurm (Dict[str, Any]): resource overrides.
    """

    value: Any
    label: str
    set: Dict[str, Any] = field(default_factory=dict)
    unset: Tuple[str, ...] = ()
    config: Optional[str] = None
    recipe: Optional[str] = None
    slurm: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Axis:
    """A named list of values (``key``: the config key the value is assigned to, if any)."""

    name: str
    key: Optional[str]
    values: Tuple[AxisValue, ...]


@dataclass
class Task:
    """One run of the sweep (one array task).

    Attributes:
        id (int): task id = SLURM array index.
        name (str): ``<label>-<label>...`` from the axis values.
        axes (Dict[str, Any]): axis name -> value.
        recipe (Optional[str]): recipe name or path (None: the pack config's own recipe).
        config (str): base config (pack name or path) after ``{axis}`` substitution.
        set (Dict[str, Any]): config overrides, base first then axes in order.
        unset (List[str]): config keys removed.
        slurm (Dict[str, Any]): resources (every TASK_SLURM_KEYS entry; None = not requested).
    """

    id: int
    name: str
    axes: Dict[str, Any]
    recipe: Optional[str]
    config: str
    set: Dict[str, Any]
    unset: List[str]
    slurm: Dict[str, Any]

    @property
    def dir_name(self) -> str:
        """Run directory name: ``<id, 3+ digits>-<name>``."""
        return f"{self.id:03d}-{self.name}"

    def describe(self) -> str:
        """``task 3 (method=qat, devices=4)`` for error messages."""
        inner = ", ".join(f"{k}={v}" for k, v in self.axes.items())
        return f"task {self.id} ({inner})" if inner else f"task {self.id}"


@dataclass
class Grid:
    """A checked grid file."""

    path: Path
    raw: Dict[str, Any]
    name: str
    config: str
    recipe: Optional[str]
    set: Dict[str, Any]
    unset: List[str]
    runs_dir: Optional[str]
    node: NodeSpec
    slurm: Dict[str, Any]
    requeue: RequeueSpec
    environment: EnvironmentSpec
    container: Optional[ContainerSpec]
    collect: CollectSpec
    templates: Optional[Path]
    dims: List[List[Tuple[Axis, ...]]]  # each dimension: one axis, or one zip group
    axes: List[Axis]
    exclude: List[Dict[str, List[Any]]]


# ------------------------------------------------------------------ checks
class _Ctx:
    """Error helper carrying the grid file name."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def err(self, where: str, msg: str) -> GridError:
        return GridError(f"{self.path}: {where}: {msg}")

    def mapping(self, node: Any, where: str, allowed: Sequence[str]) -> Dict[str, Any]:
        if node is None:
            return {}
        if not isinstance(node, Mapping):
            raise self.err(where, f"expected a mapping, got {type(node).__name__} {node!r}")
        for k in node:
            if k not in allowed:
                raise self.err(where, f"unknown key '{k}'{closest(str(k), allowed)}; known: {', '.join(allowed)}")
        return dict(node)

    def section(self, cls: type, node: Any, where: str) -> Any:
        """``cls`` (a :data:`GRID_SECTIONS` dataclass) parsed from ``node``; the first problem raises."""
        errors: List[str] = []
        out = parse_section(cls, node, where, errors, closest)
        if errors:
            raise GridError(f"{self.path}: {errors[0]}")
        return out

    def pos_int(self, v: Any, where: str, *, zero: bool = False) -> int:
        ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if zero else v > 0)
        if not ok:
            raise self.err(where, f"expected an integer {'>= 0' if zero else '> 0'}, got {v!r}")
        return v

    def string(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or not v.strip():
            raise self.err(where, f"expected a non-empty string, got {v!r}")
        return v

    def str_list(self, v: Any, where: str) -> List[str]:
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise self.err(where, f"expected a list of strings, got {v!r}")
        return list(v)

    def overrides(self, v: Any, where: str) -> Dict[str, Any]:
        if v is None:
            return {}
        if not isinstance(v, Mapping):
            raise self.err(where, f"expected a mapping of config keys to values (e.g. {{batch_size: 2}}), got {v!r}")
        for k in v:
            if not isinstance(k, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$", k):
                raise self.err(where, f"'{k}' is not a dotted config key")
        return dict(v)


def check_slurm(ctx: _Ctx, node: Any, where: str, allowed: Sequence[str], *, value_where: Optional[str] = None) -> Dict[str, Any]:
    """Check resource settings (types and the characters that may go into ``#SBATCH`` lines).

    ``value_where`` names the location of a single value (a resource axis value) in errors.
    """
    s = ctx.mapping(node, where, allowed)
    for k, v in s.items():
        w = value_where or f"{where}.{k}"
        if v is None:
            continue
        if k in ("nodes", "devices", "cpus_per_task"):
            ctx.pos_int(v, w)
        elif k == "max_concurrent":
            ctx.pos_int(v, w)
        elif k == "time":
            if isinstance(v, int) and not isinstance(v, bool):
                s[k] = v = str(v)  # minutes
            if not isinstance(v, str) or not _TIME.match(v):
                raise ctx.err(w, f"{v!r} is not a SLURM time (minutes, HH:MM:SS, D-HH:MM:SS)")
        elif k == "mem":
            if isinstance(v, int) and not isinstance(v, bool):
                s[k] = v = str(v)  # megabytes, as sbatch reads a bare number
            if not isinstance(v, str) or not _MEM.match(v):
                raise ctx.err(w, f"{v!r} is not a SLURM memory size (e.g. 64G, 500M, 0)")
        elif k == "template":
            if v not in TEMPLATES:
                raise ctx.err(w, f"{v!r} is not one of {TEMPLATES}{closest(str(v), TEMPLATES)}")
        elif k == "gpu_request":
            if v not in GPU_REQUESTS:
                raise ctx.err(w, f"{v!r} is not one of {GPU_REQUESTS}{closest(str(v), GPU_REQUESTS)}")
        elif k == "extra":
            opts = ctx.str_list(v, w)
            for o in opts:
                if not o.startswith("-") or not _SBATCH_WORD.match(o):
                    raise ctx.err(w, f"{o!r}: give one sbatch option per item (e.g. --exclusive, --mail-type=END), no spaces or quotes")
            s[k] = opts
        else:  # partition, account, qos, constraint, reservation, gpu_type, job_name
            if not isinstance(v, str) or not _SBATCH_WORD.match(v):
                raise ctx.err(w, f"{v!r}: expected one word without spaces or quotes")
    return s


def _label(axis: str, value: Any, fmt: Optional[str], where: str, ctx: _Ctx) -> str:
    if fmt is not None:
        try:
            text = str(fmt).format(value=value, axis=axis)
        except (KeyError, IndexError, ValueError) as e:
            raise ctx.err(where, f"label {fmt!r}: only {{value}} and {{axis}} may be used ({e})") from None
    elif isinstance(value, str):
        text = value
    else:
        text = f"{axis}{value}"
    text = _LABEL_BAD.sub("_", text).strip("_")
    if not text:
        raise ctx.err(where, f"value {value!r} gives an empty task-name label: give it a `label:`")
    return text


def _axis(ctx: _Ctx, name: str, node: Any, where: str) -> Axis:
    if not isinstance(name, str) or not _ENV_NAME.match(name):
        raise ctx.err(where, f"axis name {name!r} must be an identifier (letters, digits, _)")
    key: Optional[str] = None
    label_fmt: Optional[str] = None
    if isinstance(node, Mapping):
        spec = ctx.mapping(node, where, AXIS_KEYS)
        if "values" not in spec:
            raise ctx.err(where, "an axis written as a mapping needs `values:` (and usually `key:`)")
        if spec.get("key") is not None:
            key = ctx.string(spec["key"], f"{where}.key")
            ctx.overrides({key: None}, f"{where}.key")
        label_fmt = spec.get("label")
        values = spec["values"]
    else:
        values = node
    if not isinstance(values, list):
        raise ctx.err(where, f"expected a list of values, got {values!r}")
    if not values:
        raise ctx.err(where, "empty axis: give at least one value")
    out: List[AxisValue] = []
    seen: List[Any] = []
    for i, raw in enumerate(values):
        w = f"{where}[{i}]"
        if isinstance(raw, Mapping):
            spec = ctx.mapping(raw, w, VALUE_KEYS)
            if "value" not in spec:
                raise ctx.err(w, "a value written as a mapping needs `value:`")
            v = spec["value"]
            av = AxisValue(
                value=v,
                label=_label(name, v, spec.get("label", label_fmt), w, ctx),
                set=ctx.overrides(spec.get("set"), f"{w}.set"),
                unset=tuple(ctx.str_list(spec.get("unset"), f"{w}.unset")),
                config=ctx.string(spec["config"], f"{w}.config") if spec.get("config") is not None else None,
                recipe=ctx.string(spec["recipe"], f"{w}.recipe") if spec.get("recipe") is not None else None,
                slurm=check_slurm(ctx, spec.get("slurm"), f"{w}.slurm", TASK_SLURM_KEYS),
            )
        else:
            v = raw
            av = AxisValue(value=v, label=_label(name, v, label_fmt, w, ctx))
        if isinstance(v, (Mapping, list)):
            raise ctx.err(w, f"an axis value must be a scalar (write {{value: ..., set: {{...}}}} for more), got {v!r}")
        if v in seen and type(v) is type(seen[seen.index(v)]):
            raise ctx.err(w, f"value {v!r} appears twice")
        seen.append(v)
        if name in TASK_SLURM_KEYS:
            check_slurm(ctx, {name: v}, w, TASK_SLURM_KEYS, value_where=w)
        if name in SPECIAL_AXES and not isinstance(v, str):
            raise ctx.err(w, f"a {name} must be a string, got {v!r}")
        out.append(av)
    return Axis(name=name, key=key, values=tuple(out))


def _fields(text: str) -> List[str]:
    return [f for _, f, _, _ in string.Formatter().parse(text) if f]


def _yaml_loader():
    """``yaml.SafeLoader`` that reads ``3e-4`` as a float, as OmegaConf does for configs
    (YAML 1.1 alone needs ``3.0e-4``; a grid value must mean what it means in a config)."""
    import yaml

    class GridLoader(yaml.SafeLoader):
        pass

    GridLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+][0-9]+)?
            |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        list("-+0123456789."),
    )
    # YAML 1.1 reads 2:00:00 as the base-60 integer 7200: an unquoted SLURM time would become
    # 7200 minutes. Such values stay the text they are (checked first, before the int resolver).
    sexagesimal = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
    for first in "-+0123456789":
        GridLoader.yaml_implicit_resolvers.setdefault(first, []).insert(0, ("tag:yaml.org,2002:str", sexagesimal))
    return GridLoader


def load_grid(path: str | Path) -> Grid:
    """Read and check a grid file.

    Args:
        path (str | Path): the YAML grid.

    Returns:
        Grid: the checked grid.

    Raises:
        GridError: unreadable YAML or any schema problem (names the file and the key).
    """
    p = Path(path)
    ctx = _Ctx(p)
    top = _top_level(ctx, _read_yaml(p))
    axes, dims = _dimensions(ctx, top)
    config, recipe = _base_config(ctx, top, axes)
    return Grid(
        path=p.resolve(), raw=dict(top), name=top["name"], config=config, recipe=recipe,
        set=ctx.overrides(top.get("set"), "set"), unset=ctx.str_list(top.get("unset"), "unset"),
        runs_dir=ctx.string(top["runs_dir"], "runs_dir") if top.get("runs_dir") is not None else None,
        slurm=check_slurm(ctx, top.get("slurm"), "slurm", SLURM_KEYS), templates=_templates(ctx, top),
        dims=dims, axes=axes, exclude=_exclusions(ctx, top, axes), **_sections(ctx, top),
    )


def _read_yaml(p: Path) -> Any:
    import yaml

    try:
        return yaml.load(p.read_text(encoding="utf-8"), Loader=_yaml_loader())  # safe: a SafeLoader subclass
    except FileNotFoundError:
        raise GridError(f"{p}: no such grid file") from None
    except yaml.YAMLError as e:
        raise GridError(f"{p}: not valid YAML: {e}") from None


def _top_level(ctx: _Ctx, raw: Any) -> Dict[str, Any]:
    """The top-level mapping: known keys, the required ones, a name usable as a folder and job."""
    top = ctx.mapping(raw, "top level", TOP_KEYS)
    for req in ("name", "config"):
        if req not in top:
            raise ctx.err("top level", f"missing required key '{req}'")
    name = ctx.string(top["name"], "name")
    if not _NAME.match(name):
        raise ctx.err("name", f"{name!r}: use letters, digits, '.', '_', '+', '-' (it names runs/<name>/ and the SLURM job)")
    return top


def _sections(ctx: _Ctx, top: Mapping[str, Any]) -> Dict[str, Any]:
    """``node``, ``requeue``, ``environment``, ``container``, ``collect`` as their dataclasses."""
    out = {key: ctx.section(cls, top.get(key), key) for key, cls in GRID_SECTIONS.items()
           if key != "container" or top.get(key) is not None}
    out.setdefault("container", None)
    if out["requeue"].enabled is None:  # a `requeue:` section turns it on unless it says enabled: false
        out["requeue"] = dataclasses.replace(out["requeue"], enabled=top.get("requeue") is not None)
    slurm = check_slurm(ctx, out["collect"].slurm, "collect.slurm", COLLECT_SLURM_KEYS)
    out["collect"] = dataclasses.replace(out["collect"], slurm=slurm)
    return out


def _templates(ctx: _Ctx, top: Mapping[str, Any]) -> Optional[Path]:
    if top.get("templates") is None:
        return None
    templates = (ctx.path.parent / ctx.string(top["templates"], "templates")).resolve()
    if not templates.is_dir():
        raise ctx.err("templates", f"{templates} is not a directory (copy the pack's with `hlmtune cp`)")
    return templates


def _dimensions(ctx: _Ctx, top: Mapping[str, Any]) -> Tuple[List[Axis], List[List[Tuple[Axis, ...]]]]:
    """The axes, and the product's dimensions (each one axis or one zip group)."""
    axes: List[Axis] = []
    dims: List[List[Tuple[Axis, ...]]] = []
    ax_node = top.get("axes")
    if ax_node is not None and not isinstance(ax_node, Mapping):
        raise ctx.err("axes", f"expected a mapping axis -> values, got {ax_node!r}")
    for name_, node_ in (ax_node or {}).items():
        a = _axis(ctx, name_, node_, f"axes.{name_}")
        axes.append(a)
        dims.append([(a,)])
    zip_node = top.get("zip")
    if zip_node is not None and not isinstance(zip_node, list):
        raise ctx.err("zip", "expected a list of groups, each a mapping axis -> values of equal length")
    for gi, group in enumerate(zip_node or []):
        w = f"zip[{gi}]"
        if not isinstance(group, Mapping) or len(group) < 2:
            raise ctx.err(w, "a zip group is a mapping of two or more axes whose values vary together")
        members = [_axis(ctx, n, v, f"{w}.{n}") for n, v in group.items()]
        lengths = {a.name: len(a.values) for a in members}
        if len(set(lengths.values())) != 1:
            raise ctx.err(w, "zip lists differ in length: " + ", ".join(f"{n} has {k}" for n, k in lengths.items()))
        axes.extend(members)
        dims.append([tuple(members)])
    names = [a.name for a in axes]
    for n in names:
        if names.count(n) > 1:
            raise ctx.err("axes", f"axis '{n}' is defined twice")
    if not axes:
        raise ctx.err("axes", "no axes: give at least one axis (or zip group) to sweep over")
    return axes, dims


def _base_config(ctx: _Ctx, top: Mapping[str, Any], axes: List[Axis]) -> Tuple[str, Optional[str]]:
    """``config`` and ``recipe``; every ``{axis}`` they use exists, and every axis changes something."""
    config = ctx.string(top["config"], "config")
    recipe = ctx.string(top["recipe"], "recipe") if top.get("recipe") is not None else None
    names = [a.name for a in axes]
    known = set(names)
    for where, text in [("config", config), ("recipe", recipe)] + [
        (f"axes.{a.name}.{v.value}", t) for a in axes for v in a.values for t in (v.config, v.recipe)
    ]:
        for f in _fields(text or ""):
            if f not in known:
                raise ctx.err(where, f"{{{f}}} is not an axis{closest(f, known)}; axes: {', '.join(names)}")
    referenced = set(_fields(config)) | set(_fields(recipe or ""))
    for a in axes:
        for v in a.values:
            referenced |= set(_fields(v.config or "")) | set(_fields(v.recipe or ""))
    for a in axes:
        effect = a.key or a.name in TASK_SLURM_KEYS or a.name in SPECIAL_AXES or a.name in referenced
        effect = effect or any(v.set or v.unset or v.config or v.recipe or v.slurm for v in a.values)
        if not effect:
            hint = closest(a.name, [*TASK_SLURM_KEYS, *SPECIAL_AXES])  # a built-in axis misspelt
            raise ctx.err(f"axes.{a.name}", f"this axis changes nothing{hint}: give it `key:` (the config key it "
                          "sets), use it as {" + a.name + "} in `config:`, or give its values `set:`/`config:`/`slurm:`")
        if a.key and (a.name in TASK_SLURM_KEYS or a.name in SPECIAL_AXES):
            raise ctx.err(f"axes.{a.name}.key", f"'{a.name}' is a built-in axis; name a config-key axis differently")
    return config, recipe


def _exclusions(ctx: _Ctx, top: Mapping[str, Any], axes: List[Axis]) -> List[Dict[str, List[Any]]]:
    """``exclude`` entries: axis -> the values (of that axis) whose combination is left out."""
    known = {a.name: a for a in axes}
    exclude: List[Dict[str, List[Any]]] = []
    ex_node = top.get("exclude")
    if ex_node is not None and not isinstance(ex_node, list):
        raise ctx.err("exclude", "expected a list of mappings axis -> value (or list of values)")
    for i, ex in enumerate(ex_node or []):
        w = f"exclude[{i}]"
        if not isinstance(ex, Mapping) or not ex:
            raise ctx.err(w, "expected a mapping axis -> value (or list of values)")
        entry: Dict[str, List[Any]] = {}
        for k, v in ex.items():
            if k not in known:
                raise ctx.err(w, f"'{k}' is not an axis{closest(str(k), known)}")
            vals = v if isinstance(v, list) else [v]
            for x in vals:
                if not any(x == av.value for av in known[k].values):
                    raise ctx.err(f"{w}.{k}", f"{x!r} is not a value of axis '{k}' ({[av.value for av in known[k].values]})")
            entry[k] = vals
        exclude.append(entry)
    return exclude


# --------------------------------------------------------------- expansion
def _excluded(values: Mapping[str, Any], exclude: List[Dict[str, List[Any]]]) -> bool:
    return any(all(values[k] in vs for k, vs in ex.items()) for ex in exclude)


def expand(grid: Grid) -> List[Task]:
    """Expand the grid into tasks (ids 0..N-1 in product order, exclusions removed).

    Args:
        grid (Grid): a checked grid.

    Returns:
        List[Task]: the tasks, resources resolved and node limits checked.

    Raises:
        GridError: two axes setting one key to different values, a task asking for more
            than a node has, or an exclusion that leaves no task (names axis and value).
    """
    ctx = _Ctx(grid.path)
    tasks: List[Task] = []
    ranges = []
    for dim in grid.dims:
        members = dim[0]
        ranges.append(range(len(members[0].values)))
    for idx in itertools.product(*ranges):
        picks = []
        for dim, i in zip(grid.dims, idx):
            for a in dim[0]:
                picks.append((a, a.values[i]))
        values = {a.name: v.value for a, v in picks}
        if _excluded(values, grid.exclude):
            continue
        tasks.append(_task(ctx, grid, len(tasks), picks))
    if not tasks:
        raise ctx.err("exclude", "every combination is excluded: no task left")
    return tasks


def _format(ctx: _Ctx, text: str, labels: Mapping[str, Any], where: str) -> str:
    try:
        return text.format(**labels)
    except (KeyError, IndexError, ValueError) as e:
        raise ctx.err(where, f"cannot fill {text!r}: {e}") from None


def _task(ctx: _Ctx, grid: Grid, tid: int, picks: List[Tuple[Axis, AxisValue]]) -> Task:
    values = {a.name: v.value for a, v in picks}
    desc = f"task {tid} (" + ", ".join(f"{k}={v}" for k, v in values.items()) + ")"
    overrides: Dict[str, Any] = dict(grid.set)
    owner: Dict[str, str] = {}
    unset = list(grid.unset)
    config, recipe = grid.config, grid.recipe
    slurm: Dict[str, Any] = {k: grid.slurm.get(k) for k in TASK_SLURM_KEYS}
    for a, v in picks:
        sets = dict(v.set)
        if a.key:
            sets[a.key] = v.value
        for k, x in sets.items():
            if k in owner and overrides[k] != x:
                raise GridError(f"{grid.path}: {desc}: axes '{owner[k]}' and '{a.name}' both set '{k}' "
                                f"({overrides[k]!r} vs {x!r}); set it in one place")
            overrides[k] = x
            owner[k] = a.name
        unset.extend(v.unset)
        if a.name == "config":
            config = v.value
        if a.name == "recipe":
            recipe = v.value
        if v.config:
            config = v.config
        if v.recipe:
            recipe = v.recipe
        if a.name in TASK_SLURM_KEYS:
            slurm[a.name] = v.value
        slurm.update(v.slurm)
    config = _format(ctx, config, values, f"{desc}: config")
    recipe = _format(ctx, recipe, values, f"{desc}: recipe") if recipe else None
    _resources(ctx, grid, desc, slurm)
    name = "-".join(v.label for _, v in picks)
    return Task(id=tid, name=name, axes=values, recipe=recipe, config=config, set=overrides,
                unset=unset, slurm=slurm)


def _resources(ctx: _Ctx, grid: Grid, desc: str, s: Dict[str, Any]) -> None:
    """Fill defaults (1 node, 1 device, CPUs) and check them against the node."""
    s["nodes"] = s.get("nodes") or 1
    s["devices"] = s.get("devices") or 1
    s["gpu_request"] = s.get("gpu_request") or "gpus-per-node"
    s["extra"] = list(s.get("extra") or [])
    gpus, cpus = grid.node.gpus, grid.node.cpus
    if gpus:
        if s["devices"] > gpus:
            raise GridError(f"{grid.path}: {desc}: devices={s['devices']} per node but a node has {gpus} GPUs (node.gpus)")
        if s.get("cpus_per_task") is None:
            # A task's fair share of the node: CPUs in proportion to the GPUs it takes.
            s["cpus_per_task"] = max(1, cpus * s["devices"] // gpus) if cpus else s["devices"]
    else:
        if cpus and s["devices"] > cpus:
            raise GridError(f"{grid.path}: {desc}: devices={s['devices']} CPU ranks per node but a node has {cpus} CPUs (node.cpus)")
        if s.get("cpus_per_task") is None:
            s["cpus_per_task"] = s["devices"]  # one core per CPU rank
        elif s["cpus_per_task"] < s["devices"]:
            raise GridError(f"{grid.path}: {desc}: cpus_per_task={s['cpus_per_task']} is fewer than devices={s['devices']} CPU ranks")
    if cpus and s["cpus_per_task"] > cpus:
        raise GridError(f"{grid.path}: {desc}: cpus_per_task={s['cpus_per_task']} but a node has {cpus} CPUs (node.cpus)")
    s["gpus"] = s["devices"] if gpus else 0
