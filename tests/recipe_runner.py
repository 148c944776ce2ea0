"""Run pack recipes through the real CLI in tests, and read their per-step metrics as data.

Metrics come from the profiling collector's ``steps.jsonl`` (one JSON object per optimizer
step), never from scraping log text.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from conftest import HLMTUNE  # noqa: E402 - one definition of the CLI path
COLLECTOR = "hlmtune.profiling.collector.CollectorLogger"


def run_recipe(
    recipe: str,
    config: str,
    out: Path,
    *,
    model_dir: Path,
    data_dir: Path,
    nproc: Optional[int] = None,
    overrides: Sequence[str] = (),
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``hlmtune run [--nproc_per_node N] <recipe> --config <config> ...`` with the collector.

    Args:
        recipe (str): pack recipe name.
        config (str): pack config name or path.
        out (Path): run output_dir (metrics in ``out/metrics``).
        model_dir (Path): tiny model made by ``hlmtune.tiny.write_tiny_assets``.
        data_dir (Path): folder of the JSONL text samples.
        nproc (Optional[int]): ranks under torchrun; None runs one plain process.
        overrides (Sequence[str]): extra ``key=value``.
        check (bool): raise with the output tail when the run fails.

    Returns:
        subprocess.CompletedProcess: the finished run.
    """
    cmd = [HLMTUNE, "run"]
    if nproc is not None:
        cmd += ["--nproc_per_node", str(nproc)]
    cmd += [
        recipe, "--config", config,
        f"model_dir={model_dir}", f"data_dir={data_dir}", f"output_dir={out}",
        f"metric_logger._component_={COLLECTOR}", f"metric_logger.log_dir={out}/metrics",
        *overrides,
    ]
    env = dict(os.environ)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)  # time limit: pytest-timeout (pyproject)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)}\nexit {proc.returncode}\n--- stderr tail ---\n{proc.stderr[-4000:]}"
        )
    return proc


def read_steps(out: Path) -> List[Dict[str, float]]:
    """Per-step metric dicts the collector wrote for a run (``out/metrics/steps.jsonl``)."""
    path = out / "metrics" / "steps.jsonl"
    assert path.exists(), f"no {path}"
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def mean(xs: Sequence[float]) -> float:
    """Arithmetic mean."""
    return sum(xs) / len(xs)
