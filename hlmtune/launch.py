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
from pathlib import Path
from typing import TYPE_CHECKING, List

if TYPE_CHECKING:  # pragma: no cover
    from hlmtune.registry import ResolvedRecipe

# How `hlmtune run` starts each rank under torchrun: records the rank's error (see _rank.py).
RANK_RUNNER = ["-m", "hlmtune._rank"]


class PreLaunchError(ValueError):
    """Problems found before launch; ``problems`` holds one line each."""

    def __init__(self, problems: List[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def check_before_launch(cfg_path: Path, overrides: List[str], recipe: "ResolvedRecipe") -> List[str]:
    """Check a config for a recipe before launch.

    Args:
        cfg_path (Path): the resolved config file.
        overrides (List[str]): ``key=value`` / ``~key`` overrides.
        recipe (ResolvedRecipe): the resolved recipe (``spec`` None: not validated).

    Returns:
        List[str]: warnings (keys accepted but not honoured, an unvalidated recipe file).

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
                    "its config keys are not validated before launch"]
        return []
    try:
        validate_config(cfg, recipe.spec)
    except ConfigError as e:
        raise PreLaunchError(e.problems) from None
    return config_warnings(cfg, recipe.spec)


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
