"""Render the sweep's sbatch scripts from the Jinja2 templates in ``templates/``.

The environment is strict: undefined names are errors (``StrictUndefined``), nothing is
HTML-escaped, and every ``{{ ... }}`` must go through a quoting filter: ``shquote``
(``shlex.quote`` of one value), ``shjoin`` (a list, each item quoted) or ``shell_code``
(the user's own environment hook, inserted as written). A value printed without one of
them makes rendering fail, so a template edited by hand cannot forget the quoting.

A grid's ``templates:`` folder (copies made with ``hlmtune cp``) is searched before the pack's.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from hlmtune.sweep.prepare import Plan, SweepError

TEMPLATE_DIR = Path(__file__).with_name("templates")
SINGLE_NODE = "single_node.sbatch.j2"
MULTI_NODE = "multi_node.sbatch.j2"
COLLECT = "collect.sbatch.j2"


class Quoted(str):
    """A string made safe for the shell by a quoting filter."""


def shquote(value: Any) -> Quoted:
    """``shlex.quote`` of one value (numbers and booleans as their text).

    Args:
        value (Any): a scalar.

    Returns:
        Quoted: one shell word.
    """
    if isinstance(value, (list, tuple, dict)) or value is None:
        raise TypeError(f"shquote needs one scalar value, got {value!r} (use shjoin for a list)")
    return Quoted(shlex.quote(str(value)))


def shjoin(values: Iterable[Any]) -> Quoted:
    """Each item quoted, joined with spaces (a bash array body)."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"shjoin needs a list, got the string {values!r}")
    return Quoted(" ".join(shquote(v) for v in values))


def shell_code(text: str) -> Quoted:
    """The user's own shell lines (the environment hook), inserted unchanged on purpose."""
    return Quoted(str(text).rstrip("\n"))


def _finalize(value: Any) -> Any:
    if isinstance(value, Quoted):
        return value
    raise SweepError(f"template inserts {value!r} without a quoting filter: use `| shquote` (or shjoin / shell_code)")


def environment(user_dir: Optional[Path] = None):
    """The Jinja2 environment: user templates first, then the pack's.

    Args:
        user_dir (Optional[Path]): folder of edited template copies.

    Returns:
        jinja2.Environment: with the quoting filters and strict undefined names.
    """
    import jinja2

    loaders = [jinja2.FileSystemLoader(str(user_dir))] if user_dir else []
    loaders.append(jinja2.FileSystemLoader(str(TEMPLATE_DIR)))
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
        autoescape=False,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        finalize=_finalize,
    )
    env.filters.update(shquote=shquote, shjoin=shjoin, shell_code=shell_code)
    return env


def array_spec(ids: Iterable[int], max_concurrent: Optional[int] = None) -> str:
    """SLURM ``--array`` value: ``0-3,7,9-10`` plus ``%K``.

    Args:
        ids (Iterable[int]): array indices (task ids).
        max_concurrent (Optional[int]): the ``%K`` limit (None: none).

    Returns:
        str: the array specification.
    """
    xs = sorted(set(int(i) for i in ids))
    if not xs:
        raise ValueError("no array index")
    parts: List[str] = []
    start = prev = xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(parts) + (f"%{max_concurrent}" if max_concurrent else "")


def _check_path(p: str) -> None:
    # Paths land in #SBATCH lines and comments, where a quote or newline cannot be escaped.
    if any(c in p for c in "\n\r'\"\\"):
        raise SweepError(f"{p!r}: the sweep directory path must not contain quotes, backslashes or newlines")
    if "%" in p:  # sbatch reads %j, %a, %% ... in --output / --error: the logs would land elsewhere
        raise SweepError(f"{p!r}: the sweep directory path must not contain '%' (SLURM expands %-patterns "
                         "in the #SBATCH --output path)")


def _container(plan: Plan) -> Optional[Dict[str, Any]]:
    c = plan.grid.container
    if c is None:
        return None
    options: List[str] = []
    if plan.grid.node.gpus:
        options.append("--nv")  # NVIDIA driver libraries and devices inside the container
    for b in c.binds:
        options += ["--bind", b]
    options += list(c.options)
    return {"image": c.image, "runtime": c.runtime, "options": options}


def render_plan(plan: Plan, max_concurrent: Optional[int]) -> None:
    """Render every group's array script and the collect script into ``plan.scripts``.

    Args:
        plan (Plan): a built plan.
        max_concurrent (Optional[int]): ``%K`` for every array (None: no limit).
    """
    import jinja2

    _check_path(str(plan.sweep_dir))
    _check_path(plan.manifest["workdir"])
    env = environment(plan.grid.templates)
    grid = plan.grid
    hl = plan.manifest["hlmtune"]
    common = {
        "sweep": {
            "name": grid.name,
            "dir": str(plan.sweep_dir),
            "workdir": plan.manifest["workdir"],
            "grid": str(grid.path),
        },
        "hlmtune": hl,
        "env": grid.environment,
        "container": _container(plan),
        "requeue": grid.requeue,
    }
    rows = plan.manifest["tasks"]
    for g in plan.manifest["groups"]:
        s = g["slurm"]
        tasks = [{"id": r["id"], "dir": r["dir"], "args": r["argv"][len(hl) + 1:]} for r in (rows[i] for i in g["tasks"])]
        g["array"] = array_spec(g["tasks"], max_concurrent)
        ctx = dict(common)
        ctx.update(
            group={"id": g["id"], "array": g["array"], "tasks": tasks, "slurm": s},
            s=s,
            job_name=grid.slurm.get("job_name") or grid.name,
            script_path=str(plan.sweep_dir / g["script"]),
            log_pattern=str(plan.sweep_dir / "logs" / "%A_%a.out"),
            omp_threads=max(1, s["cpus_per_task"] // s["devices"]),
            template_name=MULTI_NODE if g["template"] == "multi_node" else SINGLE_NODE,
        )
        try:
            plan.scripts[g["script"]] = env.get_template(ctx["template_name"]).render(**ctx)
        except jinja2.TemplateError as e:
            raise SweepError(f"template {ctx['template_name']}: {e}") from None
    if grid.collect.enabled:
        cs = dict(grid.collect.slurm)
        for k in ("partition", "account", "qos"):
            if cs.get(k) is None:
                cs[k] = grid.slurm.get(k)  # the array's own, unless the grid names others
        cs.setdefault("time", "00:30:00")
        cs.setdefault("cpus_per_task", 1)
        cs["extra"] = list(cs.get("extra") or [])
        ctx = dict(common)
        ctx.update(s={k: cs.get(k) for k in ("partition", "account", "qos", "time", "mem", "cpus_per_task",
                                            "constraint", "reservation", "extra")},
                   job_name=f"{grid.slurm.get('job_name') or grid.name}-collect",
                   log_pattern=str(plan.sweep_dir / "logs" / "collect_%j.out"),
                   script_path=str(plan.sweep_dir / "collect.sbatch"), template_name=COLLECT)
        try:
            plan.scripts["collect.sbatch"] = env.get_template(COLLECT).render(**ctx)
        except jinja2.TemplateError as e:
            raise SweepError(f"template {COLLECT}: {e}") from None
