"""What ``hlmtune run`` checks before launch, and how it reports a failed rank.

Before any process starts (:func:`check_before_launch`): the config's environment
variables, input paths and ``output_dir`` (``hlmtune.preflight``), and, when the recipe
declares a spec (pack recipes, their copies and subclasses, user recipes with a ``SPEC``),
its keys and components (``hlmtune.training.schema``). Every problem is one line naming
the key and the value; keys accepted but not honoured come back as warnings. A recipe file
of unknown kind (no spec) runs with a warning that its config was not validated.

Under torchrun (:func:`launch_torchrun`), the elastic agent runs in this process, each
rank through ``hlmtune._rank`` (which records the rank's exception), and a failure is
reported as the failing rank's error line instead of torchrun's ``ChildFailedError`` page.
Without ``--log_dir``, torchrun leaves one ``torchelastic_*`` folder tree per run in the
temporary directory (hundreds on a node that runs sweeps); here the tree is removed after the
run unless a rank left a file in it (its ``error.json``, or output asked for with ``--redirects``).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from omegaconf import DictConfig

    from hlmtune.registry import ResolvedRecipe

# How `hlmtune run` starts each rank under torchrun: records the rank's error (see _rank.py).
RANK_RUNNER = ["-m", "hlmtune._rank"]


class PreLaunchError(ValueError):
    """Problems found before launch; ``problems`` holds one line each."""

    def __init__(self, problems: List[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def check_before_launch(cfg_path: Path, overrides: List[str],
                        recipe: "ResolvedRecipe") -> Tuple[List[str], "DictConfig"]:
    """Check a config for a recipe before launch.

    Args:
        cfg_path (Path): the resolved config file.
        overrides (List[str]): ``key=value`` / ``~key`` overrides.
        recipe (ResolvedRecipe): the resolved recipe (``spec`` None: not validated).

    Returns:
        Tuple[List[str], DictConfig]: warnings (keys accepted but not honoured, an unvalidated
        recipe file), and the config as loaded with the overrides (for the launch plan).

    Raises:
        PreLaunchError: one line per problem (missing paths, unset variables, unwritable
            output, unknown keys, bad values, bad component arguments).
    """
    from hlmtune.compat import load_config
    from hlmtune.preflight import preflight
    from hlmtune.training.schema import ConfigError, config_warnings, validate_config

    cfg = load_config(str(cfg_path), overrides)
    problems = preflight(cfg)
    if problems:
        # Every problem in one pass: keys and components too, unless the config cannot be
        # resolved (an unset variable, already named by preflight).
        if recipe.spec is not None:
            try:
                validate_config(cfg, recipe.spec)
            except ConfigError as e:
                if not str(e).startswith("cannot resolve"):  # keys first, as `hlmtune validate` lists them
                    problems = e.problems + [p for p in problems if p not in e.problems]
        raise PreLaunchError(problems)
    if recipe.spec is None:
        if recipe.path is not None and not _is_torchtune_builtin(recipe.path):
            return [f"{recipe.path.name} declares no RecipeSpec (not a pack recipe, a copy or a subclass of one): "
                    "its config keys are not validated before launch"], cfg
        return [], cfg
    try:
        validate_config(cfg, recipe.spec)
    except ConfigError as e:
        raise PreLaunchError(e.problems) from None
    return config_warnings(cfg, recipe.spec), cfg


def _is_torchtune_builtin(path: Path) -> bool:
    from hlmtune.compat import builtin_recipes

    _, root = builtin_recipes()
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def launch_torchrun(torchrun_argv: List[str]) -> int:
    """Run torchrun's elastic agent in this process; on failure print the failing rank's error.

    Args:
        torchrun_argv (List[str]): torchrun's arguments (options, then the training script
            or ``-m module``, then its arguments), as for ``python -m torch.distributed.run``.

    Returns:
        int: 0, or the first failed rank's exit code (1 when it was killed by a signal).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(torchrun_argv)
    # torchrun's default: a new torchelastic_* tree per run, never removed. Made here instead
    # (same place, same prefix) so that it can be removed when the run left nothing in it.
    own_log_dir = None
    if not args.log_dir:
        own_log_dir = args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    # The agent's own failure report (a log line per rank + the page) is replaced below.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        print(failure_summary(e), file=sys.stderr, flush=True)
        _, first = e.get_first_failure()
        return first.exitcode if first.exitcode > 0 else 1
    finally:
        if own_log_dir is not None:
            remove_empty_dirs(Path(own_log_dir))
    return 0


def remove_empty_dirs(root: Path) -> None:
    """Remove ``root`` and the folders under it that hold no file, deepest first.

    torchrun's log tree is ``<root>/<run id>_<random>/attempt_<n>/<local rank>/``; a rank's
    ``error.json`` or redirected output keeps its folders (and ``root``), nothing else does.

    Args:
        root (Path): the log folder of one run.
    """
    for folder, _, _ in os.walk(root, topdown=False):
        try:
            os.rmdir(folder)
        except OSError:  # holds a file (or a folder that does): kept
            pass


def failure_summary(e: "ChildFailedError") -> str:  # noqa: F821 - torch imported lazily
    """Lines naming the first failed rank, its exit code and its error (and the other failed ranks)."""
    rank, failure = e.get_first_failure()
    msg = failure.message
    if isinstance(msg, dict):  # error file written by hlmtune._rank: {"message": ..., "extraInfo": ...}
        msg = msg.get("message", "")
    how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"signal {failure.signal_name()}"
    if not msg or "To enable traceback" in str(msg):
        text = f"hlmtune run: rank {rank} failed ({how}); it recorded no error: see its output above"
    elif failure.exitcode < 0:
        text = f"hlmtune run: rank {rank} failed ({how})"
    else:
        text = f"hlmtune run: rank {rank} failed ({how}): {msg}"
    failed = sorted(r for r, f in e.failures.items() if r != rank and f.exitcode >= 0)
    stopped = sorted(r for r, f in e.failures.items() if r != rank and f.exitcode < 0)
    if failed:
        text += f"\nhlmtune run: {_ranks(failed)} failed too (after rank {rank})"
    if stopped:  # torchrun terminates the other ranks once one has failed
        text += f"\nhlmtune run: {_ranks(stopped)} stopped by torchrun after rank {rank} failed"
    return text


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# ------------------------------------------------------------------ CPU: ranks or threads
CPU_RANKS_ENV = "HLMTUNE_CPU_RANKS"  # "0": one process with every core's threads, as torch does
# benchmarks/peer_throughput.py --threads 1,2 --frameworks pack,pack-ranks (docs/benchmarks.md,
# 2026-12-02, 2-core host, 33M-parameter Llama3 LoRA, 8k vocabulary, wall time, two runs): 2
# ranks x 1 thread ran 1.11x and 1.03x one process x 2 threads, same loss curve within 2e-7.
CPU_RANKS_MEASURED = ("2 ranks x 1 thread ran 1.03-1.11x one process x 2 threads "
                      "(docs/benchmarks.md#threads-or-ranks-on-cpu)")


@dataclass(frozen=True)
class CpuPlan:
    """How ``hlmtune run`` starts a CPU run given without torchrun options.

    Attributes:
        ranks (int): processes to start (1: the recipe runs as one process, all threads).
        batch_size (int): ``batch_size`` of each rank (the configured one divided by ``ranks``).
        why (str): one line for the user saying what was chosen and why.
    """

    ranks: int
    batch_size: int
    why: str


def cpu_plan(cfg: "DictConfig", cores: Optional[int] = None, env: Optional[Dict[str, str]] = None,
             mem_available: Optional[int] = None) -> Optional[CpuPlan]:
    """Ranks of one thread, or one process of many: the faster where the config allows it.

    One rank per core, each with one thread and ``batch_size / ranks`` examples, keeps the
    global batch and the loss curve of one process (the ranks' sampler shards each global
    batch) and measured faster (``CPU_RANKS_MEASURED``). One process stays when asked
    (``HLMTUNE_CPU_RANKS=0`` or ``OMP_NUM_THREADS`` set), on one core, when ``batch_size``
    does not split over two or more of the cores, or when the extra copies of the model's
    parameters would take more than a quarter of the available memory.

    Args:
        cfg (DictConfig): the resolved run config (``device``, ``batch_size``, ``model``, ``dtype``).
        cores (Optional[int]): usable cores (default: this process's CPU affinity).
        env (Optional[Dict[str, str]]): environment (default: ``os.environ``).
        mem_available (Optional[int]): bytes available (default: ``/proc/meminfo``).

    Returns:
        Optional[CpuPlan]: None when the run is not on CPU (a GPU device, or none named
        while CUDA is there).
    """
    from hlmtune.training.activation_memory import mem_available_bytes

    env = os.environ if env is None else env
    device = str(cfg.get("device") or "")
    if device.startswith("cuda") or (not device and _cuda_available()):
        return None
    batch = int(cfg.get("batch_size") or 1)
    cores = cores if cores is not None else len(os.sched_getaffinity(0))

    def one(reason: str) -> CpuPlan:
        return CpuPlan(1, batch, f"CPU: one process, {reason}")

    if env.get(CPU_RANKS_ENV) == "0":
        return one(f"{CPU_RANKS_ENV}=0")
    if env.get("OMP_NUM_THREADS"):
        return one(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} threads as set")
    ranks = max((n for n in range(2, cores + 1) if batch % n == 0), default=1)
    if ranks == 1:
        return one(f"all {cores} cores' threads (batch_size {batch} does not split over 2..{cores} ranks)"
                   if cores > 1 else "1 core")
    extra = _extra_copies_bytes(cfg, ranks - 1)
    avail = mem_available if mem_available is not None else mem_available_bytes()
    if extra is not None and avail is not None and extra > avail / 4:
        return one(f"all {cores} cores' threads ({ranks - 1} more copies of the model would take "
                   f"{extra / 2**30:.1f} of {avail / 2**30:.1f} GiB available)")
    return CpuPlan(ranks, batch // ranks,
                   f"CPU: {ranks} ranks x 1 thread, batch_size {batch // ranks} each (global {batch}, as configured): "
                   f"{CPU_RANKS_MEASURED}; --nproc_per_node 1 or {CPU_RANKS_ENV}=0 runs one process")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _extra_copies_bytes(cfg: "DictConfig", copies: int) -> Optional[int]:
    """Bytes of ``copies`` more copies of the model's parameters (None when it cannot be built on meta)."""
    from hlmtune.training.schema import build_model_on_meta

    dtype = str(cfg.get("dtype", "bf16"))
    try:
        n_params = build_model_on_meta(cfg.model, dtype)
    except Exception:  # a path the builder reads is missing: preflight has said so, or it is fine
        return None
    return copies * n_params * (2 if dtype == "bf16" else 4)
