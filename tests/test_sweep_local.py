"""`hlmtune sweep --local` and `status` without SLURM: tasks one after another with a stand-in
for `hlmtune` (records its arguments, writes the run summary), failure, `--resume --local`
rerunning only the failed task with resume_from_checkpoint when a checkpoint exists."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from hlmtune.cli import main
from hlmtune.sweep.local import has_checkpoint
from sweep_helpers import write_grid, write_stub


def _calls(run_dir: Path):
    p = run_dir / "stub_calls.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_local_run_fail_status_resume(capsys, tmp_path, monkeypatch):
    grid = {"name": "loc", "config": "tiny_lora", "set": {"model_dir": "/m", "data_dir": "/d"},
            "node": {"gpus": 0, "cpus": 2},
            "environment": {"hlmtune": write_stub(tmp_path), "setup": "export SWEEP_NOTE=from-hook"},
            "axes": {"lr": {"key": "optimizer.lr", "values": [0.001, 0.002, 0.003]}, "devices": [2]}}
    g = write_grid(tmp_path / "grid.yaml", grid)
    runs = tmp_path / "runs"
    monkeypatch.setenv("STUB_FAIL", "lr0.002")  # the stand-in exits 3 for task 1
    assert main(["sweep", str(g), "--local", "--runs-dir", str(runs)]) == 1
    out = capsys.readouterr().out
    assert "2/3 task(s) complete; failed: 1" in out
    d = runs / "loc"
    # --local writes report/ after its tasks, as the collect job does after the arrays
    assert (d / "report" / "tasks.csv").is_file() and (d / "report" / "table.csv").is_file()
    dirs = [d / f"00{i}-lr0.00{i + 1}-devices2" for i in range(3)]
    first = _calls(dirs[0])[0]
    assert first["argv"] == ["run", "--nproc_per_node", "2", "lora_finetune_distributed", "--config", str(dirs[0] / "config.yaml")]
    assert first["note"] == "from-hook" and first["omp"] == "1"  # hook ran; 2 CPUs shared by 2 ranks

    assert main(["sweep", "status", str(d), "--json", "--write", str(d / "report")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["state"], r["detail"]) for r in rows] == [("done", ""), ("failed", "exit 3"), ("done", "")]
    table = list(csv.DictReader((d / "report" / "tasks.csv").open()))
    assert [(r["task"], r["lr"], r["devices"], r["state"]) for r in table] == [
        ("0", "0.001", "2", "done"), ("1", "0.002", "2", "failed"), ("2", "0.003", "2", "done")]

    # a checkpoint of the failed attempt: the rerun resumes from it
    (dirs[1] / "checkpoints" / "step_8.partial").mkdir(parents=True)  # an interrupted save does not count
    (dirs[1] / "checkpoints" / "step_8.partial" / "state.json").write_text("{}")
    assert not has_checkpoint(dirs[1])
    ck = dirs[1] / "checkpoints" / "step_4"
    ck.mkdir(parents=True)
    assert not has_checkpoint(dirs[1])  # no state.json yet: an incomplete save
    (ck / "state.json").write_text("{}")
    assert has_checkpoint(dirs[1])
    done_cfg = dirs[0] / "config.yaml"
    done_cfg.write_text(done_cfg.read_text() + "# edited after the run\n")
    monkeypatch.delenv("STUB_FAIL")
    assert main(["sweep", str(g), "--resume", "--local", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "resuming 1 task(s): 1" in out
    assert [len(_calls(x)) for x in dirs] == [1, 2, 1]
    assert _calls(dirs[1])[-1]["argv"][-1] == "resume_from_checkpoint=True"
    assert done_cfg.read_text().endswith("# edited after the run\n")  # a complete run's files are not rewritten
    assert main(["sweep", "status", str(d)]) == 0
    assert capsys.readouterr().out.strip().endswith("3 tasks: 3 done")
    assert main(["sweep", str(g), "--resume", "--local", "--runs-dir", str(runs)]) == 0
    assert "nothing to resume" in capsys.readouterr().out


def test_local_refuses_multi_node(capsys, tmp_path):
    grid = {"name": "mn", "config": "tiny_lora", "set": {"model_dir": "/m", "data_dir": "/d"},
            "node": {"gpus": 0, "cpus": 2}, "axes": {"nodes": [2]}}
    rc = main(["sweep", str(write_grid(tmp_path / "g.yaml", grid)), "--local", "--runs-dir", str(tmp_path / "r")])
    assert rc == 2 and "needs 2 nodes: --local runs single-node tasks only" in capsys.readouterr().err
