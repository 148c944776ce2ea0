"""Rendered sbatch scripts: quoting enforced by the template environment, shellcheck-clean
variants (single node, multi-node srun + c10d, Apptainer, requeue, gres, collect), and values
with spaces and ';' reaching the program as one argument when the script really runs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hlmtune.sweep.grid import expand, load_grid
from hlmtune.sweep.prepare import SweepError, build_plan, write_plan
from hlmtune.sweep.render import array_spec, environment, render_plan, shquote
from sweep_helpers import assert_shellcheck_clean, write_grid, write_stub

GPU = {"node": {"gpus": 4, "cpus": 64}}


def _plan(tmp_path: Path, grid: dict, runs: Path, k=None):
    g = load_grid(write_grid(tmp_path / f"{grid['name']}.yaml", grid))
    plan = build_plan(g, expand(g), (runs / g.name).resolve(), progress=False)
    render_plan(plan, k)
    return plan


def _base(name: str, **kw) -> dict:
    grid = {"name": name, "config": "tiny_lora",
            "set": {"model_dir": "/models/tiny", "data_dir": "/data/text", "device": "cuda"},
            **GPU, "slurm": {"partition": "gpu", "account": "p200", "time": "01:00:00", "mem": "64G"},
            "axes": {"devices": [1, 4]}}
    grid.update(kw)
    return grid


def test_array_spec():
    assert array_spec([0, 1, 2, 3]) == "0-3"
    assert array_spec([5, 0, 1, 3, 9, 10], 2) == "0-1,3,5,9-10%2"
    assert array_spec([7]) == "7"


def test_every_value_must_be_quoted(tmp_path):
    (tmp_path / "t.j2").write_text("echo {{ x }}\n")
    (tmp_path / "ok.j2").write_text("echo {{ x | shquote }} {{ xs | shjoin }}\n")
    env = environment(tmp_path)
    with pytest.raises(SweepError, match="without a quoting filter"):
        env.get_template("t.j2").render(x="a; rm -rf ~")
    assert env.get_template("ok.j2").render(x="a; rm", xs=["b c", "d"]) == "echo 'a; rm' 'b c' d\n"
    with pytest.raises(Exception, match="undefined"):  # StrictUndefined: a typo in a template fails
        env.get_template("ok.j2").render(x=1)
    assert shquote(3) == "3"


@pytest.mark.parametrize("folder,says", [("runs'x", "must not contain quotes"), ("runs%j", "must not contain '%'")])
def test_a_sweep_folder_the_scripts_cannot_name_is_refused(tmp_path, folder, says):
    """Paths land in #SBATCH lines, where quotes cannot be escaped and sbatch expands %-patterns."""
    with pytest.raises(SweepError, match=says):
        _plan(tmp_path, _base("p"), tmp_path / folder)


def test_variants_pass_shellcheck(tmp_path):
    runs = tmp_path / "runs"
    variants = [
        _base("single"),
        _base("requeue_container", requeue={"signal_seconds": 120, "save_every_n_steps": 10},
              container={"image": "/images/hlm image.sif", "binds": ["/project", "/scratch"]},
              environment={"setup": "module load Apptainer\nsource \"$HOME/venv/bin/activate\"", "vars": {"HF_HOME": "/scratch/hf cache"}}),
        _base("multi", axes={"nodes": [2, 4]}, slurm={"partition": "gpu", "gpu_request": "gres", "gpu_type": "a100",
                                                      "extra": ["--exclusive"], "max_concurrent": 2}),
        _base("mixed", axes={"devices": [1, 4], "nodes": [1, 2]}),
    ]
    for grid in variants:
        plan = _plan(tmp_path, grid, runs, k=3)
        assert plan.scripts, grid["name"]
        write_plan(plan, resume=False)
        for name in plan.scripts:
            assert_shellcheck_clean(runs / grid["name"] / name)
    multi = (runs / "multi" / "multi.g0.sbatch").read_text()
    assert "#SBATCH --nodes=2" in multi and "#SBATCH --gres=gpu:a100:1" in multi and "#SBATCH --exclusive" in multi
    assert "--rdzv_backend c10d" in multi and 'rdzv_id="${SLURM_ARRAY_JOB_ID}_${task_id}"' in multi and "srun " in multi
    assert "#SBATCH --array=0%3" in multi  # one array per resource group: task 0 (2 nodes) alone
    assert "#SBATCH --nodes=4" in (runs / "multi" / "multi.g1.sbatch").read_text()
    # devices 1 and 4 need different requests: one array each
    one, four = ((runs / "single" / f"single.g{i}.sbatch").read_text() for i in (0, 1))
    assert "#SBATCH --gpus-per-node=1" in one and "#SBATCH --cpus-per-task=16" in one and "#SBATCH --array=0%3" in one
    assert "#SBATCH --gpus-per-node=4" in four and "#SBATCH --cpus-per-task=64" in four and "#SBATCH --array=1%3" in four
    assert "#SBATCH --partition=gpu" in one and "#SBATCH --account=p200" in one and "#SBATCH --mem=64G" in one
    assert "#SBATCH --no-requeue" in one and "--nproc_per_node 4" in four and "--nproc_per_node" not in one
    rq = (runs / "requeue_container" / "requeue_container.g1.sbatch").read_text()
    assert "#SBATCH --requeue" in rq and "#SBATCH --signal=B:USR1@120" in rq and "#SBATCH --gpus-per-node=4" in rq
    assert "exec --nv --bind /project --bind /scratch '/images/hlm image.sif'" in rq
    assert "export HF_HOME='/scratch/hf cache'" in rq and "module load Apptainer" in rq
    mixed = json.loads((runs / "mixed" / "manifest.json").read_text())
    assert [(g["template"], g["tasks"]) for g in mixed["groups"]] == [
        ("single_node", [0]), ("multi_node", [1]), ("single_node", [2]), ("multi_node", [3])]


def test_values_with_spaces_and_semicolons_stay_one_argument(tmp_path):
    """Run a generated script with bash (as slurmd would): paths and values arrive intact."""
    runs = tmp_path / "my runs; touch PWNED"
    grid = {"name": "quoting", "config": "tiny_lora",
            "set": {"model_dir": "/m", "data_dir": "/d"}, "node": {"gpus": 0, "cpus": 2},
            "environment": {"hlmtune": write_stub(tmp_path), "vars": {"SWEEP_NOTE": "a b; touch PWNED2 $(id) `id`"}},
            "axes": {"tag": {"key": "dataset.data_files", "values": ["/data/x y;z.jsonl"]}}}
    plan = _plan(tmp_path, grid, runs)
    write_plan(plan, resume=False)
    script = runs / "quoting" / "quoting.sbatch"
    assert_shellcheck_clean(script)
    env = dict(os.environ, SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_JOB_ID="77", SLURM_JOB_ID="78")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = runs / "quoting" / plan.manifest["tasks"][0]["dir"]
    call = json.loads((run_dir / "stub_calls.jsonl").read_text().splitlines()[0])
    assert call["argv"] == ["run", "lora_finetune_distributed", "--config", str(run_dir / "config.yaml")]
    assert call["note"] == "a b; touch PWNED2 $(id) `id`"
    assert not list(tmp_path.rglob("PWNED*")), "a value was executed by the shell"
    # the config carries the value unchanged
    import yaml

    assert yaml.safe_load((run_dir / "config.yaml").read_text())["dataset"]["data_files"] == "/data/x y;z.jsonl"
    events = [json.loads(x) for x in (run_dir / "task_events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "end"] and events[-1]["exit_code"] == 0
    # run again: the complete run is skipped, never rerun
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "complete run found" in proc.stdout
    assert len((run_dir / "stub_calls.jsonl").read_text().splitlines()) == 1
    # a summary that is not complete is not a complete run (status and --resume say the same)
    (run_dir / "metrics" / "summary.json").write_text(json.dumps({"complete": False, "steps": 1}))
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "complete run found" not in proc.stdout
    assert len((run_dir / "stub_calls.jsonl").read_text().splitlines()) == 2
