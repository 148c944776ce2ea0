"""Run one rank's recipe and record its error for ``hlmtune run`` (``python -m hlmtune._rank``).

torchrun reports a failed rank with a ~100-line ``ChildFailedError`` page and, unless the
recipe's entry point is decorated with torchelastic's ``@record``, no error message at all.
``hlmtune run`` starts every rank through this module instead, which runs the recipe
unchanged (a pack module, a copied or user file, or a torchtune built-in) and, when it
raises, writes the exception to torchelastic's per-rank error file
(``TORCHELASTIC_ERROR_FILE``); the launcher then prints the failing rank's last error line.

Usage (what ``hlmtune run`` builds)::

    python -m hlmtune._rank -m hlmtune.recipes.lora_finetune_distributed --config ...
    python -m hlmtune._rank ./my_recipe.py --config ...
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List


def main(argv: List[str]) -> None:
    """Run the recipe named by ``argv`` (``-m MODULE`` or a script path) as ``__main__``.

    Args:
        argv (List[str]): ``["-m", module, *args]`` or ``[script, *args]``.
    """
    if not argv:
        raise SystemExit("usage: python -m hlmtune._rank (-m MODULE | SCRIPT) [ARGS ...]")
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    handler = ErrorHandler()
    handler.initialize()
    if os.environ.get("HLM_EAGER_HF_DATASETS") != "1":  # ~100 MiB less per rank; see the function
        from hlmtune.compat import import_torchtune_deferring_hf_datasets

        import_torchtune_deferring_hf_datasets()
    try:
        if argv[0] == "-m":
            module, rest = argv[1], argv[2:]
            sys.argv = [module, *rest]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script, rest = argv[0], argv[1:]
            sys.argv = [script, *rest]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py`
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            handler.record_exception(e)
            raise
    except BaseException as e:
        handler.record_exception(e)  # writes TORCHELASTIC_ERROR_FILE when torchrun set it
        raise
    _exit_without_teardown()


def _exit_without_teardown() -> None:
    """End a rank that finished cleanly without running C++ destructors.

    The recipe has closed its logs and written its outputs atomically. What remains for
    interpreter shutdown is freeing torch objects, among them the process group kept alive by
    ``hlmtune.training.dist.teardown_distributed``, whose gloo destructor can deadlock on
    the GIL. Callbacks registered with ``hlmtune.proc.before_fast_exit`` run first (``atexit``
    handlers do not: a profiler's trace is written this way), then Python-level buffers are
    flushed.
    """
    import logging

    from hlmtune.proc import run_before_fast_exit

    run_before_fast_exit()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
