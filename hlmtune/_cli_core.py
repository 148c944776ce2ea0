"""``hlmtune ls | cp | run | validate | scaling-demo``."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any, List, Optional, Tuple

from hlmtune.proc import LAUNCHER_PID_ENV

_RUN_USAGE = "hlmtune run [TORCHRUN-OPTIONS] <recipe> --config <config> [key=value ...]"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the core subcommands to the ``hlmtune`` parser."""
    p = sub.add_parser("ls", help="list the pack's recipes and configs", description="List the pack's recipes and the configs for each. torchtune's own are listed by `tune ls`.")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser(
        "cp",
        help="copy a pack recipe or config to start your own",
        description="Copy a pack recipe (.py) or config (.yaml) so you can edit it, like `tune cp`.",
        epilog="example: hlmtune cp llama3_8b_lora_alpaca ./my_lora.yaml",
    )
    p.add_argument("file", help="pack recipe or config name (see `hlmtune ls`)")
    p.add_argument("destination", help="file or directory to copy to (a .yaml/.py suffix is added if missing)")
    p.add_argument("-n", "--no-clobber", action="store_true", help="do not overwrite an existing destination")
    p.add_argument("--make-parents", action="store_true", help="create missing parent directories of the destination")
    p.set_defaults(func=_cmd_cp)

    p = sub.add_parser(
        "run",
        help="run a recipe (torchrun options forwarded)",
        usage=_RUN_USAGE,
        add_help=False,
        description="Run a pack or torchtune recipe. See `hlmtune run --help`.",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser(
        "path",
        help="print the file path of a pack recipe or config",
        description="Print where a pack recipe (.py) or config (.yaml) is installed, e.g. for `tune run`.",
        epilog="example: tune run hlmtune/recipes/lora_finetune_distributed.py --config $(hlmtune path llama3_8b_lora_alpaca)",
    )
    p.add_argument("name", help="pack recipe or config name")
    p.set_defaults(func=_cmd_path)

    p = sub.add_parser(
        "validate",
        help="check a config against a recipe without training",
        description=(
            "Check a config: unknown keys and typos (naming the closest key), every _component_ "
            "against its real signature (and the ECG beat builders' option values, before any shard "
            "exists), unset ${oc.env:...} variables, and the model built on the "
            "meta device (no memory, no weights; when a file its builder reads is missing, e.g. an ECG model's "
            "token manifest before `hlmtune tokenize`, a warning says so and the rest is still checked). "
            "Keys accepted but not honoured are printed as "
            "warnings. Overrides are applied as `hlmtune run` would."
        ),
        epilog="example: hlmtune validate --config llama3_8b_qlora_samsum batch_size=2 dtype=fp32",
    )
    p.add_argument("recipe", nargs="?", help="pack recipe or recipe file (default: the recipe a pack config is for, or the one the launch command in a copy's header names)")
    p.add_argument("--config", required=True, help="pack config name or YAML path")
    p.add_argument("--check-paths", action="store_true",
                   help="also check what `hlmtune run` checks before launch: every input path the config names "
                        "(checkpoint, tokenizer, data files, shard manifests) exists and output_dir is writable")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error (default: one line per problem)")
    p.add_argument("--no-model", action="store_true", help="skip building the model on the meta device")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser(
        "scaling-demo",
        help="tiny LoRA run at 1 and 2 ranks, collected into a scaling table (the ECG main job is `demo`)",
        description=(
            "Build a tiny 2-layer Llama3 (tokenizer + HF checkpoint), fine-tune it with LoRA on "
            "the alpaca sample at 1 and 2 ranks on this machine, and collect the runs into a "
            "table with speedup/efficiency. Needs the alpaca JSONL: --data or $HLM_DATA/text."
        ),
    )
    p.add_argument("--out", default="outputs/scaling-demo", help="output folder (default: outputs/scaling-demo)")
    p.add_argument("--data", default=None, help="alpaca-cleaned JSONL (default: $HLM_DATA/text/alpaca_cleaned.jsonl)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default: 20)")
    p.add_argument("--max-ranks", type=int, default=2, help="largest world size to run (default: 2)")
    p.set_defaults(func=_cmd_demo)


# ---------------------------------------------------------------------------- ls / cp
def _cmd_ls(args: argparse.Namespace) -> int:
    from hlmtune.registry import list_pack

    print(f"{'RECIPE':<32} CONFIGS")
    for recipe, desc, configs in list_pack():
        print(f"{recipe:<32} {desc}")
        for c in configs:
            print(f"{'':<32}   {c}")
    from hlmtune.sweep.files import pack_files

    print(f"\n{'SWEEP TEMPLATES AND GRIDS':<32} (`hlmtune sweep`, docs/sweep.md; copy with `hlmtune cp`)")
    for name in pack_files():
        print(f"{'':<32}   {name}")
    print("\ntorchtune's own recipes and configs are available too: `tune ls`.")
    return 0


def _pack_file(name: str) -> Optional[Path]:
    from hlmtune.registry import RECIPES, config_path, recipes_dir

    stem = name[:-3] if name.endswith(".py") else name
    if stem in RECIPES:
        return recipes_dir() / f"{stem}.py"
    from hlmtune.sweep.files import pack_file

    return config_path(name) or pack_file(name)  # sweep templates and example grids too


def _closest_pack_name(name: str) -> str:
    """`` (did you mean 'X'?)`` for the pack recipe, config, template or grid closest to ``name``."""
    import difflib

    from hlmtune.registry import CONFIGS, RECIPES
    from hlmtune.sweep.files import pack_files

    names = [*RECIPES, *CONFIGS, *pack_files()]
    close = difflib.get_close_matches(name, names, n=1) or difflib.get_close_matches(
        name[:-5] if name.endswith(".yaml") else name[:-3] if name.endswith(".py") else name, names, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _cmd_path(args: argparse.Namespace) -> int:
    p = _pack_file(args.name)
    if p is None or not p.exists():
        print(f"hlmtune path: '{args.name}' is not a pack recipe or config{_closest_pack_name(args.name)} "
              "(see `hlmtune ls`)", file=sys.stderr)
        return 2
    print(p)
    return 0


def _cmd_cp(args: argparse.Namespace) -> int:
    name = args.file
    src = _pack_file(name)
    if src is None or not src.exists():
        print(f"hlmtune cp: '{name}' is not a pack recipe or config{_closest_pack_name(name)} "
              "(see `hlmtune ls`; torchtune's: `tune cp`)", file=sys.stderr)
        return 2
    dest = Path(args.destination)
    if dest.is_dir():
        dest = dest / src.name
    elif dest.suffix == "":
        dest = dest.with_suffix(src.suffix)
    if not dest.parent.exists():
        if not args.make_parents:
            print(f"hlmtune cp: {dest.parent} does not exist (use --make-parents)", file=sys.stderr)
            return 2
        dest.parent.mkdir(parents=True)
    if dest.exists() and args.no_clobber:
        print(f"hlmtune cp: {dest} exists, not overwritten (--no-clobber)", file=sys.stderr)
        return 0
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
    print(f"Copied {src.name} to {dest}")
    return 0


# ---------------------------------------------------------------------------- run

def config_arg(args: List[str]) -> Optional[Tuple[int, str]]:
    """Where the config is named in a command line: ``--config X`` or ``--config=X``.

    Both spellings are what argparse (and so torchtune's ``config.parse``) accepts.

    Args:
        args (List[str]): command-line words.

    Returns:
        Optional[Tuple[int, str]]: (index of the ``--config`` word, the value), or None when
        there is no ``--config`` with a value.
    """
    for k, word in enumerate(args):
        if word == "--config":
            return (k, args[k + 1]) if k + 1 < len(args) else None
        if word.startswith("--config="):
            return k, word.split("=", 1)[1]
    return None


def _header_hint(argv: List[str]) -> str:
    """"; its header launches it with <recipe>" for the --config of ``argv``, when it says so."""
    from hlmtune.registry import recipe_in_header, resolve_config

    found = config_arg(argv)
    if found is None or not found[1]:
        return ""
    value = found[1]
    try:
        recipe = recipe_in_header(resolve_config(value))
    except (FileNotFoundError, ValueError):
        return ""
    return f"; {value}'s header launches it with {recipe}" if recipe else ""


def split_run_args(argv: List[str]):
    """Split ``hlmtune run`` arguments into torchrun flags, recipe and recipe args.

    torchrun's own parser decides which leading tokens are its options, exactly as in
    ``tune run``; the first positional is the recipe.

    Args:
        argv (List[str]): arguments after ``run``.

    Returns:
        tuple: (torchrun_args, recipe, recipe_args, parsed torchrun namespace)
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> None:  # argparse would print torchrun's whole usage page and exit
        # No recipe: torchrun's parser then meets --config among its own options, or no script.
        if "--config" in message or "training_script" in message:
            raise ValueError(f"name the recipe before --config: {_RUN_USAGE} (recipes: `hlmtune ls`)"
                             + _header_hint(argv))
        raise ValueError(f"{message} (usage: {_RUN_USAGE}; torchrun options: `torchrun --help`)")

    parser.error = error  # type: ignore[method-assign]
    ns = parser.parse_args(argv)
    recipe = ns.training_script
    rest = list(ns.training_script_args)
    n_flags = len(argv) - len(rest) - 1
    return argv[:n_flags], recipe, rest, ns


def _cmd_run(args: argparse.Namespace) -> int:
    return run_cli(list(args.rest))


def run_cli(argv: List[str]) -> int:
    """``hlmtune run`` with its raw arguments."""
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:  # a bare `hlmtune run` is a mistake, not a request for help
            print(_run_help(), file=sys.stderr)
            return 2
        print(_run_help())
        return 0
    found = config_arg(argv)
    debug = "--debug" in argv[: found[0] if found else len(argv)]
    if debug:  # an hlmtune flag before the recipe's arguments, not torchrun's
        argv = [a for i, a in enumerate(argv) if not (a == "--debug" and i == argv.index("--debug"))]
    return run_command(argv, debug=debug)


def _run_help() -> str:
    return textwrap.dedent(
        f"""\
        usage: {_RUN_USAGE}

        Run a recipe: pack recipes first (`hlmtune ls`), then a .py path, then torchtune's
        built-ins (`tune ls`). Configs resolve the same way: pack config name, file path,
        torchtune config name. Without torchrun options the recipe runs as one process
        (world size 1), except a pack recipe on CPU: one rank of one thread per core, each
        with batch_size / ranks (the global batch as configured; measured faster than one
        process of as many threads), said in one line; --nproc_per_node 1,
        HLMTUNE_CPU_RANKS=0 or OMP_NUM_THREADS keep one process. Any torchrun option
        (--nproc_per_node, --nnodes, --rdzv_backend, --rdzv_endpoint, --rdzv_id,
        --node_rank ...) launches it under torchrun, standalone unless --rdzv_endpoint is given.

        Before any process starts: every ${{oc.env:...}} variable is set, every input path the
        config names exists (checkpoint dir/files, tokenizer files, data files, shard
        manifests), output_dir is writable, and, for recipes that declare a RecipeSpec (pack
        recipes, files copied with `hlmtune cp` or subclassing one, your own with a SPEC),
        every key and component argument is checked. Each problem is one line naming the key;
        exit status 2. Keys accepted but not honoured are printed as warnings. A recipe file
        without a spec runs with a warning that its config was not validated.
        Under torchrun, a failed rank is reported by its error line; the exit status is
        non-zero when any rank failed.

        hlmtune options (before the recipe):
          --debug   print the traceback of an error found before launch, and of a dataset error in a rank

        examples:
          hlmtune run lora_finetune_distributed --config llama3_8b_lora_alpaca
          hlmtune run --nproc_per_node 4 lora_finetune_distributed --config llama3_8b_qlora_samsum batch_size=2 dtype=fp32
          hlmtune run --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 --rdzv_id $SLURM_JOB_ID \\
              full_finetune_distributed --config my_ecg.yaml

        `tune run` runs pack recipes too when given their module path as a file path:
          tune run hlmtune/recipes/lora_finetune_distributed.py --config $(hlmtune path llama3_8b_lora_alpaca)
        """
    )


def build_run_command(argv: List[str]) -> List[str]:
    """The command line ``hlmtune run`` executes (exposed for tests and SLURM templates).

    Args:
        argv (List[str]): arguments after ``run``.

    Returns:
        List[str]: argv for ``os.execv`` (``python -m torch.distributed.run ...`` or
        ``python -m hlmtune.recipes.<name> ...``).

    Raises:
        ValueError: no ``--config``, unknown recipe or config, or an invalid pack config.
    """
    return plan_run(argv)[0]


def plan_run(argv: List[str]):
    """Resolve, check before launch (see ``hlmtune/launch.py``) and build the command.

    Returns:
        tuple: (command as :func:`build_run_command`, warnings to print, torchrun used, notes
        to print: how a CPU run is split over ranks or threads, see ``hlmtune.launch.cpu_plan``).

    Raises:
        ValueError: as :func:`build_run_command`; ``PreLaunchError`` (a ValueError) holds
            one line per problem.
    """
    from hlmtune.launch import RANK_RUNNER, check_before_launch, cpu_plan
    from hlmtune.registry import resolve_config, resolve_recipe

    torchrun_args, recipe_name, rest, ns = split_run_args(argv)
    _check_process_counts(ns)
    found = config_arg(rest)
    if found is None or not found[1]:
        raise ValueError("the --config argument is required: hlmtune run <recipe> --config <config> [key=value ...]")
    k = found[0]
    rest[k:k + (1 if rest[k] != "--config" else 2)] = ["--config", found[1]]  # --config=X: one spelling below
    i = k + 1
    recipe = resolve_recipe(recipe_name)
    cfg_path = resolve_config(rest[i])
    rest[i] = str(cfg_path)
    overrides = rest[:i - 1] + rest[i + 1:]
    warnings, cfg = check_before_launch(cfg_path, overrides, recipe)
    notes: List[str] = []
    target = ["-m", recipe.module] if recipe.module else [str(recipe.path)]
    if not torchrun_args and recipe.spec is not None:  # a pack recipe on CPU: ranks or threads
        plan = cpu_plan(cfg)
        if plan is not None:
            notes.append(plan.why)
            if plan.ranks > 1:
                torchrun_args = ["--nproc_per_node", str(plan.ranks)]
                rest = rest + [f"batch_size={plan.batch_size}"]
    if torchrun_args:
        extra = []
        if not ns.rdzv_endpoint and not ns.standalone and "--standalone" not in torchrun_args:
            extra = ["--standalone"]  # as `tune run`: several single-node jobs can share a host
        # Each rank runs through hlmtune._rank, which records its error for the summary.
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, *extra, *RANK_RUNNER, *target, *rest]
        return cmd, warnings, True, notes
    return [sys.executable, *target, *rest], warnings, False, notes


def _check_process_counts(ns: argparse.Namespace) -> None:
    """torchrun asserts on a count below 1 (a bare ``AssertionError`` page): say which flag."""
    for flag, value in (("--nproc_per_node", ns.nproc_per_node), ("--nnodes", ns.nnodes)):
        for part in str(value).split(":"):  # --nnodes MIN:MAX
            try:
                n = int(part)
            except ValueError:
                if flag == "--nproc_per_node" and part in ("auto", "cpu", "gpu", "xpu"):
                    continue  # torchrun counts the devices itself
                raise ValueError(f"{flag} {value}: not a count" + (
                    " (an integer, or auto / cpu / gpu / xpu)" if flag == "--nproc_per_node" else
                    " (an integer, or MIN:MAX)")) from None
            if n < 1:
                raise ValueError(f"{flag} {value}: needs at least 1 (e.g. {flag} 2)")


def run_command(argv: List[str], debug: bool = False) -> int:
    """Check before launch, then run: one process (exec) or torchrun's agent in this process.

    Args:
        argv (List[str]): arguments after ``run`` (without ``--debug``).
        debug (bool): print the traceback of a pre-launch error.

    Returns:
        int: 2 for a user error found before launch; the run's exit status otherwise
        (non-zero when any rank failed).
    """
    from hlmtune.launch import PreLaunchError, launch_torchrun
    from hlmtune.training.schema import ConfigError

    try:
        cmd, warnings, torchrun, notes = plan_run(argv)
    except PreLaunchError as e:
        for line in e.problems:
            print(f"hlmtune run: {line}", file=sys.stderr)
        if debug:
            traceback.print_exc()
        return 2
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"hlmtune run: {e}", file=sys.stderr)
        if debug:
            traceback.print_exc()
        return 2
    for line in warnings:
        print(f"hlmtune run: warning: {line}", file=sys.stderr)
    for line in notes:
        print(f"hlmtune run: {line}", file=sys.stderr)
    print("Running: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    sys.stdout.flush()
    # The ranks torchrun starts die with it; this pid survives the exec (hlmtune/proc.py).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if debug:  # the recipe keeps the traceback of a data error (hlmtune/training/recipe.py)
        os.environ["HLM_DEBUG"] = "1"
    if torchrun:
        return launch_torchrun(cmd[3:])  # cmd = [python, -m, torch.distributed.run, ...]
    os.execv(cmd[0], cmd)
    return 0  # not reached


# ---------------------------------------------------------------------------- validate
def validate_cli(argv: List[str]) -> int:
    """``hlmtune validate`` with its raw arguments (recipe, --config and overrides in any order)."""
    parser = argparse.ArgumentParser(prog="hlmtune")  # the subcommand adds " validate" to its usage line
    sub = parser.add_subparsers()
    register(sub)
    p = sub.choices["validate"]
    args = p.parse_intermixed_args(argv)
    return args.func(args)


def _cmd_validate(args: argparse.Namespace) -> int:
    from hlmtune.launch import PreLaunchError
    from hlmtune.registry import resolve_config
    from hlmtune.training.schema import ConfigError, config_warnings

    try:
        path = resolve_config(args.config)
    except FileNotFoundError as e:
        print(f"hlmtune validate: {e}", file=sys.stderr)
        return 2
    recipe = _validate_recipe_name(args, path)
    if recipe is None:
        return 2
    try:
        resolved, cfg, n_params, unbuilt = _validate_checks(args, path, recipe)
    except (ConfigError, PreLaunchError) as e:
        for line in e.problems:
            print(f"hlmtune validate: {path}: {line}", file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return 2
    except ValueError as e:
        msg = str(e) if str(e).startswith(f"{path}:") else f"{path}: {e}"  # YAML errors name the file
        print(f"hlmtune validate: {msg}", file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return 2
    for line in config_warnings(cfg, resolved.spec):
        print(f"hlmtune validate: warning: {line}", file=sys.stderr)
    if unbuilt:
        print(f"hlmtune validate: warning: model not built on the meta device: {unbuilt}", file=sys.stderr)
    model = cfg.model.get("_component_", "?")
    if n_params:
        size = f", {n_params / 1e9:.2f}B" if n_params >= 1e9 else f", {n_params / 1e6:.1f}M"
        size += " params built on meta"
    else:
        size = "; not built: a file it reads is missing" if unbuilt else ""
    print(f"OK: {path.name} is valid for {resolved.spec.name} (model {model}{size})")
    return 0


def _validate_recipe_name(args: argparse.Namespace, path: Path) -> Optional[str]:
    """The recipe to validate against (given, the config's, or its header's); None after saying why not.

    Positionals may come in any order around ``--config``: the recipe is the one word that is
    not a ``key=value`` / ``~key`` override (``args.recipe`` / ``args.overrides`` are rewritten so).
    """
    from hlmtune.registry import RECIPES, recipe_for_config, recipe_in_header

    words = ([args.recipe] if args.recipe else []) + list(args.overrides)
    names = [w for w in words if "=" not in w and not w.startswith("~")]
    if len(names) > 1:
        print(f"hlmtune validate: more than one recipe given: {names}", file=sys.stderr)
        return None
    args.recipe = names[0] if names else None
    args.overrides = [w for w in words if w not in names]
    recipe = args.recipe or recipe_for_config(args.config)
    if recipe is None:
        recipe = recipe_in_header(path)  # a copy under another name keeps its header's launch command
        if recipe is not None:
            print(f"hlmtune validate: recipe {recipe}, named by the launch command in {args.config}'s header "
                  "(name another: hlmtune validate <recipe> --config ...)", file=sys.stderr)
    if recipe is None:
        print(f"hlmtune validate: name the recipe for {args.config}: hlmtune validate <recipe> --config ... (recipes: {', '.join(RECIPES)})", file=sys.stderr)
    return recipe


def _validate_checks(args: argparse.Namespace, path: Path, recipe: str) -> Tuple[Any, Any, Optional[int], Optional[str]]:
    """(resolved recipe, config, parameters built on meta, why the model was not built).

    Raises:
        ConfigError, PreLaunchError: every key, component and (``--check-paths``) path problem in one pass.
        ValueError: a recipe without a spec, unreadable YAML.
    """
    from hlmtune.compat import load_config
    from hlmtune.launch import PreLaunchError
    from hlmtune.preflight import env_problems, preflight
    from hlmtune.registry import resolve_recipe
    from hlmtune.training.schema import ConfigError, build_model_on_meta, validate_config

    resolved = resolve_recipe(recipe)
    if resolved.spec is None:
        raise ValueError(f"{recipe} declares no RecipeSpec: nothing to validate its config against "
                         "(pack recipes, their copies and subclasses, or a recipe class with SPEC = RecipeSpec(...))")
    cfg = load_config(str(path), args.overrides)
    env = env_problems(cfg)
    if env:
        raise PreLaunchError(env)
    problems: List[str] = []
    try:
        validate_config(cfg, resolved.spec)
    except ConfigError as e:
        problems += e.problems
    if args.check_paths:
        problems += [p for p in preflight(cfg) if p not in problems]
    if problems:
        raise PreLaunchError(problems)
    n_params, unbuilt = None, None
    if not args.no_model:
        try:
            n_params = build_model_on_meta(cfg.model, cfg.get("dtype", "bf16"))
        except FileNotFoundError as e:
            # A file the model's builder reads (the ECG models' token manifest, for the vocabulary
            # size): paths are problems only with --check-paths; otherwise the config is still
            # checked, and the user told what to make first.
            if args.check_paths:
                raise PreLaunchError([str(e)]) from None
            unbuilt = str(e)
    return resolved, cfg, n_params, unbuilt


# ---------------------------------------------------------------------------- demo
def _cmd_demo(args: argparse.Namespace) -> int:
    from hlmtune.scaling_demo import run_demo

    return run_demo(out=Path(args.out), data=args.data, steps=args.steps, max_ranks=args.max_ranks)
