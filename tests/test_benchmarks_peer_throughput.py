"""Smoke run of benchmarks/peer_throughput.py at a toy size: every framework trains the same
model on the same rows (identical first-step loss), and the summary and ratios are printed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "peer_throughput.py"
TOY = ["--layers", "1", "--dim", "128", "--seq-len", "32", "--batch-size", "2", "--steps", "3", "--warmup", "1",
       "--repeats", "1", "--synthetic"]


def _trl_installed() -> bool:
    return importlib.util.find_spec("trl") is not None and importlib.util.find_spec("peft") is not None


def _run(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_peer_benchmark_smoke(tmp_path):
    frameworks = "pack,torchtune,trl" if _trl_installed() else "pack,torchtune"
    # Shipped defaults: each framework at the speed knobs of its own Llama3-8B config.
    proc = _run([*TOY, "--frameworks", frameworks, "--pack-defaults", "--peer-defaults"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    names = frameworks.split(",")
    for name in names:  # one summary row each: tok/s, median s/step, RSS, first-step loss
        assert re.search(rf"^{name}(\s+[\d.]+){{6}}$", out, re.M), out
    for name in names[1:]:
        assert re.search(rf"first-step loss {name} vs pack: .* identical within rtol", out), out
        assert re.search(rf"pack / {name}: speed [\d.]+x \(wall\), [\d.]+x \(CPU time\), peak RSS [\d.]+x", out), out
    assert "pack vs faster peer" in out
    assert "torchtune: enable_activation_checkpointing=True" in out  # read from torchtune's own 8B config
    assert "pack at its shipped defaults (enable_activation_checkpointing=auto" in out
    for name in names[1:]:  # checkpointing and fused AdamW change time, not the loss curve
        dev = re.search(rf"loss curve pack vs {name} \(3 steps, first repeat\): max relative difference (\S+)", out)
        assert dev and float(dev.group(1)) < 1e-3, out
    # The shared rows and the one config both frameworks ran.
    assert (tmp_path / "work" / "rows.npz").is_file() and (tmp_path / "work" / "config.yaml").is_file()


def test_peer_benchmark_rejects_bad_flags(tmp_path):
    proc = _run(["--frameworks", "pack,tt"], tmp_path)
    assert proc.returncode == 2 and "unknown ['tt']" in proc.stderr
    proc = _run(["--steps", "2", "--warmup", "2"], tmp_path)
    assert proc.returncode == 2 and "--warmup 2 must be < --steps 2" in proc.stderr


@pytest.mark.slow
def test_thread_counts_vocabulary_and_labels_in_one_run(tmp_path):
    # Issue 45's options: several thread counts in one invocation, a padded vocabulary, fully labelled rows.
    proc = _run(["--layers", "1", "--dim", "128", "--seq-len", "32", "--batch-size", "2", "--steps", "3",
                 "--warmup", "1", "--repeats", "1", "--frameworks", "pack,pack-ranks,torchtune", "--threads", "1,2",
                 "--vocab-size", "2048", "--all-labelled"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "vocabulary 2048 (padded; tokenizer ids 768)" in out
    assert re.search(r"thread counts \[1, 2\]", out)
    for t in (1, 2):
        assert f"; {t} thread(s)\n" in out and re.search(rf"first-step loss torchtune vs pack: .* identical", out)
    table = out.split("wall-time tokens/s (median repeat) by intra-op threads", 1)[1].splitlines()
    assert re.match(r"\s+1\s+[\d.]+\s+-\s+[\d.]+\s+-\s+[\d.]+x$", table[2]), table  # pack-ranks: 2+ threads only
    assert re.match(r"\s+2(\s+[\d.]+){3}(\s+[\d.]+x){2}$", table[3]), table
    assert re.search(r"scaling 2 / 1 thread\(s\): pack [\d.]+x, torchtune [\d.]+x", out)
    # the pack as 2 ranks x 1 thread beside its 1 process x 2 threads: measured at 2 threads only, same loss
    assert re.search(r"first-step loss pack-ranks vs pack: .* identical", out) and "pack / pack-ranks: speed" in out
    assert not (tmp_path / "work" / "pack-ranks_t1_rep0.log").exists()
    import numpy as np

    rows = np.load(tmp_path / "work" / "rows.npz")
    if os.environ.get("HLM_DATA"):  # real alpaca rows: every position a target
        assert (rows["labels"] != -100).all()


def test_thread_counts_parse(tmp_path):
    proc = _run(["--threads", "0"], tmp_path)
    assert proc.returncode == 2 and "thread counts are positive integers or 'all'" in proc.stderr
