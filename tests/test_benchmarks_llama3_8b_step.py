"""benchmarks/llama3_8b_step.py on CPU: the scaled-down model end to end, the full size refused, the estimate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_helpers import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "llama3_8b_step.py"
SMALL = ["--layers", "2", "--dim", "256", "--intermediate", "512", "--heads", "4", "--kv-heads", "2", "--vocab", "2048"]


def _module():
    return load_benchmark("llama3_8b_step")


def _run(args, tmp_path):
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--work", str(tmp_path / "work")], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=900)


@pytest.mark.slow
def test_scaled_down_pack_and_torchtune_side_by_side(tmp_path):
    proc = _run([*SMALL, "--steps", "3", "--warmup", "1", "--methods", "lora", "--dtypes", "fp32", "--ac", "off"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "work" / "results.json").read_text())
    rows = {r["framework"]: r for r in res["results"]}
    assert rows["pack"]["status"] == rows["torchtune"]["status"] == "ok"
    assert rows["pack"]["loss_first"] == pytest.approx(rows["torchtune"]["loss_first"], rel=1e-4)  # same model, same rows
    assert rows["pack"]["steps"] == 3 and rows["pack"]["s_per_it"] > 0
    assert res["model"]["vocab"] == 2048 and "papers: 0.77 s/it" in proc.stdout
    assert "random token ids" in res["rows"] and "device: CPU" in proc.stdout


def test_the_full_size_is_refused_on_cpu_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    proc = _run([], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "needs a GPU" in proc.stderr


def test_rows_follow_the_alpaca_lengths(tmp_path):
    mod = _module()
    data = tmp_path / "text"
    data.mkdir()
    rows = [{"instruction": "x" * 40, "input": "", "output": "y" * 400}, {"instruction": "x" * 80, "input": "", "output": "y" * 40}]
    (data / "alpaca_cleaned.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seq, share, note = mod.row_shape(str(data), 2)
    assert seq == round(40 / 4 + 30 + 400 / 4)  # the longer of the two: template + characters / 4
    assert 0 < share < 1 and "random token ids" in note
    assert mod.row_shape(None, 2)[0] == 512


def test_memory_estimate_adds_up(tmp_path):
    mod = _module()
    args = mod.parse_args(SMALL + ["--batch-size", "2"])
    lora = mod.memory_needed_gib(args, "lora", "fp32", "off", 64)
    full_ac = mod.memory_needed_gib(args, "lora", "fp32", "full", 64)
    qat = mod.memory_needed_gib(args, "qat", "fp32", "off", 64)
    longer = mod.memory_needed_gib(args, "lora", "fp32", "off", 256)
    weights = (2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256) + 2 * 2048 * 256 + 256) * 4 / 1024 ** 3
    assert weights < full_ac < lora < longer  # activations grow with the row, checkpointing keeps less
    assert qat > lora  # every weight trains: gradients and AdamW states for all of them
