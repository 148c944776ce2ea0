"""Run directories: steps reading (truncated / corrupt lines), percentiles, summaries, discovery."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hlmtune.profiling.runs import (
    RunReadError,
    atomic_write_json,
    find_run_dirs,
    load_run,
    percentile,
    read_steps,
    summarize_steps,
)


def test_percentile_matches_numpy_linear() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 17):
        xs = rng.random(n).tolist()
        for q in (0, 50, 90, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert percentile([], 50) is None


def test_truncated_last_line_is_dropped_and_reported(tmp_path: Path) -> None:
    p = tmp_path / "steps.jsonl"
    p.write_text('{"step": 1, "iteration_time_s": 1.0}\n{"step": 2, "iteration_time_s": 2.0}\n{"step": 3, "itera')
    recs, notes = read_steps(p)
    assert [r["step"] for r in recs] == [1, 2]
    assert len(notes) == 1 and f"{p}:3: truncated last line" in notes[0]


def test_corrupt_line_is_skipped_and_named_by_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "steps.jsonl"
    p.write_text('{"step": 1}\n{"oops"\n{"step": 3}\n')
    recs, notes = read_steps(p)
    assert [r["step"] for r in recs] == [1, 3]
    assert len(notes) == 1 and notes[0].startswith(f"{p}:2: corrupt line skipped (not JSON")
    p.write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n')
    recs, notes = read_steps(p)
    assert [r["step"] for r in recs] == [1, 3] and "'step' key" in notes[0]
    # JSON, but not a step count: skipped and named, not a crash of the summary that follows
    p.write_text('{"step": 1}\n{"step": null}\n{"step": "x"}\n{"step": 4, "steps_elapsed": "a"}\n{"step": true}\n'
                 '{"step": 6, "steps_elapsed": 2}\n')
    recs, notes = read_steps(p)
    assert [r["step"] for r in recs] == [1, 6] and len(notes) == 4
    assert all("must be whole numbers" in n for n in notes) and summarize_steps(recs, warmup_steps=0, world_size=1)


def test_summary_definitions() -> None:
    recs = [
        {"step": 1, "steps_elapsed": 1, "iteration_time_s": 5.0, "tokens": 10, "peak_rss_gib": 1.0, "loss": 3.0},
        {"step": 2, "steps_elapsed": 1, "iteration_time_s": 1.0, "tokens": 10, "peak_rss_gib": 1.5, "loss": 2.5},
        {"step": 4, "steps_elapsed": 2, "iteration_time_s": 2.0, "tokens": 20, "peak_rss_gib": 1.2, "loss": 2.0,
         "peak_rss_gib_rank1": 0.7},
    ]
    s = summarize_steps(recs, warmup_steps=1, world_size=2)
    assert s["steps"] == 4 and s["iteration_time_s_mean"] == pytest.approx(1.5)
    assert s["total_time_s"] == pytest.approx(5.0 + 1.0 + 2 * 2.0)
    # post-warmup tokens / post-warmup time: (10 + 2*20) / (1 + 2*2)
    assert s["tokens_per_second"] == pytest.approx(50 / 5) and s["tokens_per_second_per_gpu"] == pytest.approx(5)
    assert s["tokens_total"] == 10 + 10 + 40
    assert s["peak_rss_gib"] == 1.5 and s["peak_rss_gib_rank1"] == 0.7
    assert (s["loss_first"], s["loss_last"]) == (3.0, 2.0)
    empty = summarize_steps([], warmup_steps=1)
    assert empty["steps"] == 0 and empty["total_time_s"] is None


def test_atomic_json_and_non_finite(tmp_path: Path) -> None:
    atomic_write_json(tmp_path / "a" / "x.json", {"v": float("nan"), "t": (1, 2)})
    assert json.loads((tmp_path / "a" / "x.json").read_text()) == {"v": None, "t": [1, 2]}
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["x.json"]  # no temp file left


def test_find_run_dirs_and_superseded(tmp_path: Path) -> None:
    for d in ("a/metrics", "b/metrics", "b/metrics/superseded-20260101T000000Z"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "run.json").write_text("{}")
    dirs, problems = find_run_dirs([tmp_path, tmp_path / "missing"])
    assert dirs == [tmp_path / "a/metrics", tmp_path / "b/metrics"]
    reasons = {Path(p["path"]).name: p["reason"] for p in problems}
    assert reasons["missing"].startswith("missing") and reasons["superseded-20260101T000000Z"].startswith("superseded")


def test_load_run_without_summary_is_partial(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"world_size": 1, "warmup_steps": 0}))
    (tmp_path / "steps.jsonl").write_text('{"step": 1, "iteration_time_s": 0.5}\n')
    r = load_run(tmp_path)
    assert r["summary"]["complete"] is False and r["summary"]["total_time_s"] == 0.5
    (tmp_path / "summary.json").write_text(json.dumps({"complete": True, "wall_time_s": 3.0}))
    r = load_run(tmp_path)
    assert r["summary"]["complete"] is True and r["summary"]["wall_time_s"] == 3.0
    (tmp_path / "run.json").write_text("{")
    with pytest.raises(RunReadError, match="run.json: not valid JSON"):
        load_run(tmp_path)
    for name in ("run.json", "summary.json"):  # valid JSON that is not an object
        (tmp_path / "run.json").write_text("{}")
        (tmp_path / name).write_text("[1]")
        with pytest.raises(RunReadError, match=f"{name}: expected a JSON object, got list"):
            load_run(tmp_path)


def test_closed_run_with_truncated_last_line_keeps_its_written_summary(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"world_size": 1, "warmup_steps": 0, "status": "closed"}))
    (tmp_path / "steps.jsonl").write_text('{"step": 1, "iteration_time_s": 0.5}\n{"step": 2, "iteration_ti')
    written = {"complete": True, "wall_time_s": 3.0, "steps": 2, "last_step": 2, "total_time_s": 1.0}
    (tmp_path / "summary.json").write_text(json.dumps(written))
    r = load_run(tmp_path)
    s = r["summary"]
    assert s["complete"] is True and s["steps"] == 2 and s["total_time_s"] == 1.0
    assert any("truncated last line dropped" in n and "closed normally" in n for n in r["notes"])
    assert not any("summary.json missing" in n for n in r["notes"])
