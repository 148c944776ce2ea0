"""``hlmtune collect``: scaling table, formulas against raw steps, problems, exit codes."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from hlmtune.cli import main as hlmtune_main
from hlmtune.profiling.analysis import T_DEFINITION, collect
from hlmtune.profiling.collector import CollectorLogger


def make_run(
    log_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    world_size: int,
    step_times: List[float],
    tokens_per_step: int,
    method: str = "lora",
    dataset: str = "alpaca_dataset",
    template: str = "AlpacaToMessages",
    warmup_steps: int = 1,
    close: bool = True,
    rss_gib: float = 1.0,
    extra_info: Optional[Dict] = None,
) -> CollectorLogger:
    """A run as a pack recipe writes it: rank 0 logs the contract keys every step."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
    logger = CollectorLogger(log_dir=str(log_dir), warmup_steps=warmup_steps)
    logger.log_run_info({
        "recipe": "lora_finetune_distributed", "method": method, "model": "lora_llama3", "dataset": dataset,
        "template": template, "world_size": world_size, "nodes": 1, "device": "cpu", "dtype": "fp32",
        "pin_memory": False, "num_workers": 0, "batch_size": 2, "gradient_accumulation_steps": 1,
        "data_parallel": world_size, **(extra_info or {}),
    })
    for i, t in enumerate(step_times, start=1):
        payload = {
            "loss": 5.0 - 0.01 * i, "lr": 1e-4, "tokens": tokens_per_step, "tokens_per_second": tokens_per_step / t,
            "tokens_per_second_per_gpu": tokens_per_step / t / world_size, "iteration_time_s": t, "data_time_s": 0.1 * t,
            "peak_rss_gib": rss_gib + 0.01 * world_size - 0.001 * i,  # this step's peak
            "peak_rss_since_start_gib": rss_gib + 0.5,  # setup's peak is the larger one
        }
        for r in range(world_size):
            payload[f"peak_rss_gib_rank{r}"] = rss_gib + 0.01 * r
        logger.log_dict(payload, step=i)
    if close:
        logger.close()
    return logger


def _raw_total(run_dir: Path) -> float:
    """T straight from steps.jsonl: sum of iteration_time_s x steps_elapsed."""
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    return sum(json.loads(l)["iteration_time_s"] * json.loads(l)["steps_elapsed"] for l in lines)


def _rows(out: Path) -> List[Dict[str, str]]:
    with open(out / "table.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture()
def scaling_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One config at 1 and 2 ranks: the 2-rank run does half the steps of the same epoch."""
    rng = random.Random(0)
    root = tmp_path / "runs"
    t1 = [0.9] + [0.5 + 0.02 * rng.random() for _ in range(11)]
    t2 = [1.0] + [0.55 + 0.02 * rng.random() for _ in range(5)]
    make_run(root / "n1" / "metrics", monkeypatch, world_size=1, step_times=t1, tokens_per_step=100)
    make_run(root / "n2" / "metrics", monkeypatch, world_size=2, step_times=t2, tokens_per_step=200)
    return root


def test_speedup_efficiency_overhead_match_formulas_from_raw_steps(scaling_runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "table"
    res = collect([scaling_runs], out)
    rows = {int(r["devices"]): r for r in _rows(out)}
    assert set(rows) == {1, 2}
    T1 = _raw_total(scaling_runs / "n1" / "metrics")
    T2 = _raw_total(scaling_runs / "n2" / "metrics")
    s = T1 / T2
    assert float(rows[2]["total_time_s"]) == pytest.approx(T2)
    assert float(rows[2]["speedup"]) == pytest.approx(s)
    assert float(rows[2]["efficiency"]) == pytest.approx(s / 2)
    assert float(rows[2]["overhead_s"]) == pytest.approx(T2 - T1 / 2)
    assert float(rows[1]["speedup"]) == pytest.approx(1.0)
    assert float(rows[1]["overhead_s"]) == pytest.approx(0.0)
    # Per-iteration (throughput) speedup from the post-warmup steps only.
    def tps(d: Path) -> float:
        recs = [json.loads(l) for l in (d / "steps.jsonl").read_text().splitlines()][1:]
        return sum(r["tokens"] for r in recs) / sum(r["iteration_time_s"] for r in recs)
    assert float(rows[2]["speedup_tput"]) == pytest.approx(tps(scaling_runs / "n2" / "metrics") / tps(scaling_runs / "n1" / "metrics"))
    # Mean iteration time excludes the warmup step.
    recs = [json.loads(l) for l in (scaling_runs / "n1" / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert float(rows[1]["iteration_time_s_mean"]) == pytest.approx(sum(r["iteration_time_s"] for r in recs[1:]) / 11)
    # Peak over steps = the largest step peak (step 1's); since start = the process peak.
    assert float(rows[2]["peak_rss_over_steps_gib"]) == pytest.approx(1.02 - 0.001)
    assert float(rows[2]["peak_rss_since_start_gib"]) == pytest.approx(1.5)
    assert res["problems"] == []
    md = (out / "table.md").read_text()
    assert T_DEFINITION in md and "| speedup | efficiency | overhead_s |" in md
    assert json.loads((out / "problems.json").read_text()) == []


def test_group_without_baseline_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_run(tmp_path / "r" / "a", monkeypatch, world_size=2, step_times=[0.5] * 4, tokens_per_step=10)
    res = collect([tmp_path / "r"], tmp_path / "o", plots=False)
    (row,) = res["rows"]
    assert row.get("speedup") is None and row.get("efficiency") is None
    assert row["baseline"].startswith("none")
    assert any("no 1-device baseline" in p["reason"] for p in res["problems"])
    assert "no 1-device baseline" in (tmp_path / "o" / "problems.md").read_text()


def test_mismatched_work_is_listed_and_not_compared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Same number of steps at 2 ranks = twice the tokens: not the same work.
    make_run(tmp_path / "r" / "n1", monkeypatch, world_size=1, step_times=[0.5] * 6, tokens_per_step=100)
    make_run(tmp_path / "r" / "n2", monkeypatch, world_size=2, step_times=[0.6] * 6, tokens_per_step=200)
    res = collect([tmp_path / "r"], tmp_path / "o", plots=False)
    row2 = next(r for r in res["rows"] if r["devices"] == 2)
    assert row2.get("speedup") is None and row2.get("overhead_s") is None
    assert row2["speedup_tput"] == pytest.approx((200 / 0.6) / (100 / 0.5))
    assert any(p["reason"].startswith("mismatched") for p in res["problems"])


def test_repeats_that_did_different_work_are_not_averaged_into_a_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two 1-device runs of one setting, 8 and 16 steps: their mean T is no run's, so neither the
    # row's nor the 2-device row's T-based scaling is computed; throughput still compares.
    make_run(tmp_path / "r" / "a", monkeypatch, world_size=1, step_times=[1.0] * 9, tokens_per_step=100)
    make_run(tmp_path / "r" / "b", monkeypatch, world_size=1, step_times=[1.0] * 17, tokens_per_step=100)
    # the 2-device run did the mean of their work (13 x 100 tokens): only the row check tells
    make_run(tmp_path / "r" / "n2", monkeypatch, world_size=2, step_times=[1.0] * 13, tokens_per_step=100)
    res = collect([tmp_path / "r"], tmp_path / "o", plots=False)
    one = next(r for r in res["rows"] if r["devices"] == 1)
    two = next(r for r in res["rows"] if r["devices"] == 2)
    assert one["n_runs"] == 2 and two.get("speedup") is None and two.get("efficiency") is None
    assert two.get("overhead_s") is None and two["speedup_tput"] == pytest.approx(1.0)
    assert any(p["reason"].startswith("mismatched: the 2 runs of this row did different work") for p in res["problems"])
    # repeats of the same work still average
    make_run(tmp_path / "s" / "a", monkeypatch, world_size=1, step_times=[1.0] * 9, tokens_per_step=100)
    make_run(tmp_path / "s" / "b", monkeypatch, world_size=1, step_times=[1.2] * 9, tokens_per_step=100)
    make_run(tmp_path / "s" / "n2", monkeypatch, world_size=2, step_times=[0.6] * 9, tokens_per_step=100)
    res = collect([tmp_path / "s"], tmp_path / "o2", plots=False)
    two = next(r for r in res["rows"] if r["devices"] == 2)
    assert two["speedup"] == pytest.approx(1.1 / 0.6) and not any("mismatched" in p["reason"] for p in res["problems"])


def test_partial_run_is_listed_with_reason_and_truncated_line_tolerated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_run(tmp_path / "r" / "n1", monkeypatch, world_size=1, step_times=[0.5] * 6, tokens_per_step=100)
    log = make_run(tmp_path / "r" / "killed", monkeypatch, world_size=2, step_times=[0.5] * 3, tokens_per_step=200, close=False)
    log._steps_f.close()
    steps = tmp_path / "r" / "killed" / "steps.jsonl"
    # The process died in the middle of writing a 4th line.
    with open(steps, "a") as f:
        f.write('{"step": 4, "steps_elapsed": 1, "iteration_ti')
    res = collect([tmp_path / "r"], tmp_path / "o", plots=False)
    assert [r["devices"] for r in res["rows"]] == [1]  # the killed run is not in the table...
    reasons = [p["reason"] for p in res["problems"] if "killed" in p["path"]]
    assert any("truncated last line" in r for r in reasons)  # ...but listed, with why
    assert any(r.startswith("partial: no summary.json") and "3 steps logged" in r for r in reasons)
    res2 = collect([tmp_path / "r"], tmp_path / "o2", plots=False, include_partial=True)
    partial = next(r for r in res2["rows"] if r["devices"] == 2)
    assert partial["status"] == "partial" and partial.get("speedup") is None and partial["steps"] == 3


def test_missing_paths_and_empty_dirs_are_problems_and_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    rc = hlmtune_main(["collect", str(tmp_path / "nope"), str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "missing: path does not exist" in err and "no run.json or steps.jsonl" in err
    assert "error: no run directory found" in err
    assert not (tmp_path / "o").exists()  # nothing written, not even an empty table


def test_cli_collect_writes_table_and_plots(scaling_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "o"
    rc = hlmtune_main(["collect", str(scaling_runs / "n1" / "metrics"), str(scaling_runs / "n2"), "--out", str(out)])
    assert rc == 0
    assert "2 row(s) from 2 run(s)" in capsys.readouterr().out
    for name in ("table.csv", "table.md", "problems.md", "problems.json", "speedup_efficiency_vs_devices.png"):
        assert (out / name).stat().st_size > 0


def test_repeated_runs_are_averaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_run(tmp_path / "r" / "a", monkeypatch, world_size=1, step_times=[0.4] * 5, tokens_per_step=100)
    make_run(tmp_path / "r" / "b", monkeypatch, world_size=1, step_times=[0.6] * 5, tokens_per_step=100)
    res = collect([tmp_path / "r"], tmp_path / "o", plots=False)
    (row,) = res["rows"]
    assert row["n_runs"] == 2
    assert row["total_time_s"] == pytest.approx((0.4 * 5 + 0.6 * 5) / 2)


def test_batch_accumulation_and_sequence_length_are_group_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs that differ in batch size, accumulation or sequence length are never averaged, and a
    2-device run is compared with the 1-device run of the same global batch (strong scaling)."""
    variants = {"b2": {"batch_size": 2}, "b4": {"batch_size": 4}, "ga2": {"batch_size": 2, "gradient_accumulation_steps": 2},
                "s512": {"batch_size": 2, "max_seq_len": 512}}
    for name, info in variants.items():
        make_run(tmp_path / "r" / name, monkeypatch, world_size=1, step_times=[0.5 + 0.1 * len(name)] * 4,
                 tokens_per_step=100, extra_info={"max_seq_len": 256, **info})
    make_run(tmp_path / "r" / "n2", monkeypatch, world_size=2, step_times=[0.3] * 4, tokens_per_step=100,
             extra_info={"batch_size": 2, "max_seq_len": 256})
    res = collect([tmp_path / "r"], tmp_path / "o", plots=False)
    ones = {(r["batch_size"], r["gradient_accumulation_steps"], r["max_seq_len"]): r for r in res["rows"] if r["devices"] == 1}
    assert set(ones) == {(2, 1, 256), (4, 1, 256), (2, 2, 256), (2, 1, 512)}
    assert all(r["n_runs"] == 1 for r in res["rows"])
    (two,) = [r for r in res["rows"] if r["devices"] == 2]
    # global batch 2 x 1 x 2 = 4: the 1-device batch-4 run (same tokens), not the batch-2 one.
    assert two["baseline"].startswith("1-device row, same global batch")
    assert two["speedup"] == pytest.approx(ones[(4, 1, 256)]["total_time_s"] / two["total_time_s"])
    cols = (tmp_path / "o" / "table.csv").read_text().splitlines()[0].split(",")
    assert {"batch_size", "gradient_accumulation_steps", "max_seq_len"} <= set(cols)


def test_corrupt_middle_line_is_skipped_and_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    """One bad line costs that step, not the run; the exit status is non-zero only when a run is lost."""
    make_run(tmp_path / "r" / "a", monkeypatch, world_size=1, step_times=[0.4] * 3, tokens_per_step=100)
    steps = tmp_path / "r" / "a" / "steps.jsonl"
    lines = steps.read_text().splitlines()
    lines[1] = "garbage"
    steps.write_text("\n".join(lines) + "\n")
    res = collect([tmp_path / "r"], tmp_path / "o", plots=False)
    (row,) = res["rows"]
    assert row["steps"] == 3 and row["status"] == "complete"  # closed run: its summary.json counts all 3
    assert any(f"{steps}:2: corrupt line skipped" in p["reason"] for p in res["problems"])
    assert hlmtune_main(["collect", str(tmp_path / "r"), "--out", str(tmp_path / "o2"), "--no-plots"]) == 0
    assert f"{steps}:2: corrupt line skipped" in capsys.readouterr().err
    # A run that cannot be read at all is lost: the others are still tabled, the exit status says so.
    make_run(tmp_path / "r" / "b", monkeypatch, world_size=1, step_times=[0.4] * 3, tokens_per_step=100)
    (tmp_path / "r" / "b" / "run.json").write_text("{")
    assert hlmtune_main(["collect", str(tmp_path / "r"), "--out", str(tmp_path / "o3"), "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert "run.json: not valid JSON" in err and "1 run(s) lost" in err
    assert (tmp_path / "o3" / "table.csv").exists()


def test_truncated_last_line_of_a_closed_run_is_reported_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """summary.json exists and run.json says closed: the run is complete, only a line of its log is cut."""
    make_run(tmp_path / "r" / "n1", monkeypatch, world_size=1, step_times=[0.5] * 4, tokens_per_step=100)
    steps = tmp_path / "r" / "n1" / "steps.jsonl"
    steps.write_bytes(steps.read_bytes()[:-20])  # the last line loses its end
    res = collect([tmp_path / "r"], tmp_path / "o", plots=False)
    (row,) = res["rows"]
    assert row["status"] == "complete" and row["steps"] == 4  # summary.json (written at close) holds all 4
    assert row["total_time_s"] == pytest.approx(2.0)
    reasons = [p["reason"] for p in res["problems"]]
    assert not any("no summary.json" in r for r in reasons), reasons
    assert any(f"{steps}:4: truncated last line dropped" in r and "closed normally" in r for r in reasons), reasons


@pytest.mark.slow
def test_pack_recipe_one_and_two_ranks_collected(tmp_path: Path, text_data_dir: Path) -> None:
    """The real pack recipe at 1 and 2 ranks (same 8 samples), collector set on the command line."""
    import os
    import subprocess
    import sys

    from hlmtune.tiny import write_tiny_assets

    write_tiny_assets(tmp_path / "model")
    hlmtune = Path(sys.executable).with_name("hlmtune")
    env = dict(os.environ, HLM_DATA=str(text_data_dir.parent))
    for n, steps in ((1, 4), (2, 2)):  # the same 8 samples (shuffle off) at 1 and 2 ranks
        out = tmp_path / f"n{n}"
        cmd = [str(hlmtune), "run", "--nproc_per_node", str(n), "lora_finetune_distributed", "--config", "tiny_lora",
               f"model_dir={tmp_path / 'model'}", f"data_dir={text_data_dir}", f"output_dir={out}",
               f"max_steps_per_epoch={steps}", "batch_size=2", "shuffle=False", "save_adapter_weights_only=True",
               "metric_logger._component_=hlmtune.profiling.collector.CollectorLogger",
               f"metric_logger.log_dir={out / 'metrics'}",
               "metric_logger.wrapped._component_=torchtune.training.metric_logging.DiskLogger",
               f"metric_logger.wrapped.log_dir={out / 'logs'}"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = json.loads((out / "metrics" / "run.json").read_text())
        assert run["run_info_from_recipe"] is True and run["world_size"] == n and run["recipe"] == "lora_finetune_distributed"
        rec = json.loads((out / "metrics" / "steps.jsonl").read_text().splitlines()[-1])
        assert {f"peak_rss_gib_rank{r}" for r in range(n)} <= set(rec) and rec["iteration_time_source"] == "recipe"
        assert len(list((out / "logs").glob("log_*.txt"))) == 1  # the user's DiskLogger still wrote
    res = collect([tmp_path / "n1", tmp_path / "n2"], tmp_path / "table")
    assert res["problems"] == []
    rows = {int(r["devices"]): r for r in _rows(tmp_path / "table")}
    T1, T2 = _raw_total(tmp_path / "n1" / "metrics"), _raw_total(tmp_path / "n2" / "metrics")
    assert float(rows[1]["tokens_total"]) == float(rows[2]["tokens_total"])  # same work
    assert float(rows[2]["speedup"]) == pytest.approx(T1 / T2)
    assert float(rows[2]["efficiency"]) == pytest.approx(T1 / T2 / 2)
    assert float(rows[2]["overhead_s"]) == pytest.approx(T2 - T1 / 2)
    for png in ("iteration_time_vs_devices.png", "speedup_efficiency_vs_devices.png", "overhead_vs_devices.png"):
        assert (tmp_path / "table" / png).stat().st_size > 5000


def test_readme_profiling_loop_gets_speedup_and_per_device_batch_with_a_step_limit_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's loop (batch 2, accumulation 8/n, 100 steps) vs keeping the per-device batch."""
    steps, tokens = 5, 1600  # tokens per optimizer step of global batch 16
    for n in (1, 2, 4):  # README: same global batch, same steps -> same work
        make_run(tmp_path / "readme" / f"n{n}", monkeypatch, world_size=n, step_times=[1.0 if n == 1 else 1.0 / (0.9 * n)] * steps,
                 tokens_per_step=tokens, extra_info={"batch_size": 2, "gradient_accumulation_steps": 8 // n})
    res = collect([tmp_path / "readme"], tmp_path / "o", plots=False)
    by_n = {r["devices"]: r for r in res["rows"]}
    assert by_n[4]["baseline"].startswith("1-device row, same global batch")
    assert by_n[2]["speedup"] == pytest.approx(1.8) and by_n[4]["efficiency"] == pytest.approx(0.9)
    for n in (1, 2):  # per-device batch kept, step limit: the 2-device run does twice the work
        make_run(tmp_path / "per_device" / f"n{n}", monkeypatch, world_size=n, step_times=[0.6] * steps,
                 tokens_per_step=200 * n, extra_info={"batch_size": 2, "gradient_accumulation_steps": 1})
    res = collect([tmp_path / "per_device"], tmp_path / "o2", plots=False)
    two = next(r for r in res["rows"] if r["devices"] == 2)
    assert two.get("speedup") is None and two["speedup_tput"] == pytest.approx(2.0)
    assert any(p["reason"].startswith("mismatched: 2-device run") for p in res["problems"])
