"""`hlmtune sweep` through the real command line (in process): the shipped example grids pass
--dry-run, bad input is one line with exit status 2 before anything is written, `hlmtune cp`
copies the templates and grids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlmtune.cli import main
from sweep_helpers import write_grid

GRIDS = Path(__file__).resolve().parents[1] / "hlmtune" / "sweep" / "grids"


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _manifest(out: str) -> dict:
    body = out.split("\n", 1)[1]  # after the "# manifest.json ..." line
    return json.JSONDecoder().raw_decode(body)[0]


def test_ecg_paper_grid_dry_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "sweep", str(GRIDS / "ecg_paper_sweep.yaml"), "--dry-run")
    assert rc == 0, err
    m = _manifest(out)
    assert len(m["tasks"]) == 36 and {t["base_config"].rsplit("/", 1)[-1] for t in m["tasks"]} == {"ecg_pretrain.yaml"}
    windows = sorted({t["set"]["dataset.max_seq_len"] for t in m["tasks"]})
    assert windows == [128, 256, 512, 1024]
    assert {(t["slurm"]["cpus_per_task"], t["slurm"]["devices"]) for t in m["tasks"]} == {
        (c, d) for c in (8, 16, 32) for d in (1, 2, 4)}
    assert len(m["groups"]) == 9 and all("#SBATCH --requeue" in out for _ in [0])
    assert "#SBATCH --gpus-per-node=4" in out and "--nproc_per_node 4" in out and "#SBATCH --cpus-per-task=32" in out
    assert not (tmp_path / "runs").exists(), "a dry run writes nothing"
    assert "36 task configs validated" in err


def test_llm_paper_grid_dry_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "sweep", str(GRIDS / "llm_paper_sweep.yaml"), "--dry-run", "--container", "/img/hlm.sif")
    assert rc == 0, err
    m = _manifest(out)
    names = {Path(t["base_config"]).stem for t in m["tasks"]}
    assert names == {f"llama3_8b_{meth}_{ds}" for meth in ("lora", "qlora", "qat", "qat_lora") for ds in ("alpaca", "samsum", "grammar")} | {
        "llama3_8b_lora_dpo_stack_exchange"}
    assert len(m["tasks"]) == 66
    assert all(t["set"]["dataset.subset_size"] == 500 for t in m["tasks"])
    assert not any(t["axes"]["method"] == "qat" and t["slurm"]["devices"] < 4 for t in m["tasks"])
    assert {t["set"]["data_loader.pin_memory"] for t in m["tasks"]} == {True, False}
    assert "exec --nv /img/hlm.sif" in out and m["container"]["image"] == "/img/hlm.sif"


def _tiny(tmp_path, **kw):
    grid = {"name": "t", "config": "tiny_lora", "set": {"model_dir": "/m", "data_dir": "/d"},
            "node": {"gpus": 0, "cpus": 2}, "axes": {"lr": {"key": "optimizer.lr", "values": [0.001, 0.002]}}}
    grid.update(kw)
    return write_grid(tmp_path / "grid.yaml", grid)


def test_failing_config_names_task_axis_and_closest_key(capsys, tmp_path):
    g = _tiny(tmp_path, axes={"bs": {"values": [{"value": 2, "set": {"batch_size": 2}},
                                                {"value": 3, "set": {"batch_sise": 3}}]}})
    rc, out, err = _run(capsys, "sweep", str(g), "--runs-dir", str(tmp_path / "runs"))
    assert rc == 2 and "Traceback" not in err
    assert "task 1 (bs=3)" in err and "batch_sise" in err and "batch_size" in err
    assert not (tmp_path / "runs").exists(), "nothing written when a task fails validation"


def test_gpu_mismatch_and_bad_flags(capsys, tmp_path):
    rc, _, err = _run(capsys, "sweep", str(_tiny(tmp_path, node={"gpus": 4})), "--dry-run")
    assert rc == 2 and "device=cpu but would request 1 GPU(s)" in err
    rc, _, err = _run(capsys, "sweep", str(_tiny(tmp_path)), "--dry-run", "--max-concurrent", "0")
    assert rc == 2 and "--max-concurrent 0" in err
    rc, _, err = _run(capsys, "sweep", "status")
    assert rc == 2 and "usage: hlmtune sweep status SWEEP_DIR" in err
    rc, _, err = _run(capsys, "sweep", "status", str(tmp_path))
    assert rc == 2 and "not a sweep directory" in err


def test_write_then_refuse_reuse(capsys, tmp_path):
    runs = tmp_path / "runs"
    g = _tiny(tmp_path)
    rc, out, err = _run(capsys, "sweep", str(g), "--runs-dir", str(runs))
    assert rc == 0, err
    d = runs / "t"
    m = json.loads((d / "manifest.json").read_text())
    assert [t["dir"] for t in m["tasks"]] == ["000-lr0.001", "001-lr0.002"]
    assert (d / "000-lr0.001" / "config.yaml").exists() and (d / "t.sbatch").exists() and (d / "collect.sbatch").exists()
    assert f"sbatch {d / 't.sbatch'}" in out
    rc, _, err = _run(capsys, "sweep", str(g), "--runs-dir", str(runs))
    assert rc == 2 and "already exists (0/2 tasks complete)" in err and "--resume" in err
    # --resume of a changed grid is refused too
    g2 = _tiny(tmp_path, axes={"lr": {"key": "optimizer.lr", "values": [0.001, 0.005]}})
    rc, _, err = _run(capsys, "sweep", str(g2), "--runs-dir", str(runs), "--resume", "--local")
    assert rc == 2 and "tasks changed since the sweep was created (first difference at task 1)" in err


@pytest.mark.parametrize("name", ["single_node.sbatch.j2", "multi_node.sbatch", "ecg_paper_sweep", "llm_paper_sweep.yaml"])
def test_cp_copies_templates_and_grids(capsys, tmp_path, name):
    rc, out, err = _run(capsys, "cp", name, str(tmp_path))
    assert rc == 0, err
    copied = list(tmp_path.iterdir())
    assert len(copied) == 1 and copied[0].read_text() and copied[0].name.startswith(name.split(".")[0])
    rc, out, _ = _run(capsys, "ls")
    assert "ecg_paper_sweep.yaml" in out and "single_node.sbatch.j2" in out


def test_user_templates_override_the_packs(capsys, tmp_path):
    tdir = tmp_path / "tpl"
    tdir.mkdir()
    assert main(["cp", "single_node.sbatch.j2", str(tdir)]) == 0
    t = tdir / "single_node.sbatch.j2"
    t.write_text(t.read_text().replace("{% block launch %}", "{% block launch %}\n# site-specific: {{ sweep.name | shquote }}"))
    rc, out, err = _run(capsys, "sweep", str(_tiny(tmp_path, templates="tpl")), "--dry-run")
    assert rc == 0, err
    assert "# site-specific: t" in out
