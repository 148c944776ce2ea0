"""`hlmtune sweep` through the real command line (in process): the shipped example grids pass
--dry-run, bad input is one line with exit status 2 before anything is written, `hlmtune cp`
copies the templates and grids, shipped grids run by name and every documented example is real."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
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


def test_a_copied_config_keeps_its_recipe_and_a_bare_one_must_name_it(capsys, tmp_path):
    """A copy under another name sweeps with the recipe its header launches; a config without
    such a header is one line asking for `recipe:`."""
    src = Path(__file__).resolve().parents[1] / "configs" / "tiny_lora.yaml"
    copy = tmp_path / "my_tiny.yaml"
    copy.write_text(src.read_text())
    rc, out, err = _run(capsys, "sweep", str(_tiny(tmp_path, config=str(copy))), "--dry-run")
    assert rc == 0, err
    assert {t["recipe"] for t in _manifest(out)["tasks"]} == {"lora_finetune_distributed"}
    bare = tmp_path / "bare.yaml"
    bare.write_text("\n".join(line for line in src.read_text().splitlines() if not line.startswith("#")))
    rc, _, err = _run(capsys, "sweep", str(_tiny(tmp_path, config=str(bare))), "--dry-run")
    assert rc == 2 and "header names no `hlmtune run <recipe>`" in err and "recipe:" in err
    rc, out, err = _run(capsys, "sweep", str(_tiny(tmp_path, config=str(bare), recipe="lora_finetune_distributed")),
                        "--dry-run")
    assert rc == 0, err


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


def _snapshot(d: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in d.iterdir()}


def test_shipped_grid_by_name_dry_runs_and_writes_under_cwd(capsys, tmp_path, monkeypatch):
    """A shipped grid by name (no file of that path here) dry-runs, then writes ``./runs/<name>``, never the package."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HLM_DATA", str(tmp_path / "data"))
    before = _snapshot(GRIDS)
    rc, out, err = _run(capsys, "sweep", "tiny_cpu_sweep", "--dry-run")
    assert rc == 0, err
    m = _manifest(out)
    assert m["name"] == "tiny_cpu" and len(m["tasks"]) == 4 and m["grid"] == str(GRIDS / "tiny_cpu_sweep.yaml")
    assert not (tmp_path / "runs").exists()
    rc, out, err = _run(capsys, "sweep", "tiny_cpu_sweep.yaml")  # the header's spelling; writes the sweep
    assert rc == 0, err
    assert (tmp_path / "runs" / "tiny_cpu" / "manifest.json").exists() and f"-> {tmp_path / 'runs' / 'tiny_cpu'}" in out
    assert _snapshot(GRIDS) == before and not (GRIDS / "runs").exists(), "nothing written into the installed package"


@pytest.mark.parametrize("name, closest", [("tiny", "tiny_cpu_sweep.yaml"), ("tiny.yaml", "tiny_cpu_sweep.yaml"),
                                           ("ecg_paper.yaml", "ecg_paper_sweep.yaml"), ("llm_papr_sweep", "llm_paper_sweep.yaml")])
def test_unknown_grid_name_exit_2_names_closest(capsys, tmp_path, monkeypatch, name, closest):
    """Neither a file nor a shipped grid: one line, exit 2, the closest shipped grid and how to list them."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "sweep", name, "--dry-run")
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"did you mean '{closest}'?" in err and "`hlmtune ls`" in err
    assert not (tmp_path / "runs").exists()
    rc, out, _ = _run(capsys, "ls")  # the command the message names lists the shipped grids
    assert rc == 0 and closest in out


def test_local_file_wins_over_shipped_grid(capsys, tmp_path, monkeypatch):
    """A file at the given path is used even when a shipped grid has the same name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HLM_DATA", str(tmp_path / "data"))  # the shipped grid would dry-run too: only the name tells
    write_grid(tmp_path / "tiny_cpu_sweep.yaml", {"name": "mine", "config": "tiny_lora", "set": {"model_dir": "/m", "data_dir": "/d"},
                                                  "node": {"gpus": 0, "cpus": 2}, "axes": {"lr": {"key": "optimizer.lr", "values": [0.001]}}})
    rc, out, err = _run(capsys, "sweep", "tiny_cpu_sweep.yaml", "--dry-run")
    assert rc == 0, err
    m = _manifest(out)
    assert m["name"] == "mine" and len(m["tasks"]) == 1 and Path(m["grid"]).resolve() == tmp_path / "tiny_cpu_sweep.yaml"


def _sweep_parser() -> argparse.ArgumentParser:
    from hlmtune.sweep.cli import register

    sub = argparse.ArgumentParser(prog="hlmtune").add_subparsers()
    register(sub)
    return sub.choices["sweep"]


def _examples():
    """(where, command line) of every ``hlmtune ...`` / ``python -c`` example: the sweep help, then each grid header."""
    help_text = _sweep_parser().format_help()
    yield "hlmtune sweep --help", [ln.strip() for ln in help_text.split("examples:", 1)[1].splitlines()]
    for g in sorted(GRIDS.glob("*.yaml")):
        header = []
        for ln in g.read_text().splitlines():
            if not ln.startswith("#"):
                break
            header.append(ln.lstrip("#").strip())
        yield g.name, header


def test_help_and_grid_header_examples_are_real():
    """Every grid, config, flag and sweep directory the examples name exists; grids by name resolve to shipped grids."""
    from hlmtune.sweep.files import pack_file, pack_grids

    flags = {o for a in _sweep_parser()._actions for o in a.option_strings}
    names = {__import__("yaml").safe_load(p.read_text())["name"] for p in GRIDS.glob("*.yaml")}
    checked = 0
    for where, lines in _examples():
        copied = set()
        for line in lines:
            m = re.match(r'python -c "from ([\w.]+) import (\w+);', line)
            if m:
                assert hasattr(importlib.import_module(m.group(1)), m.group(2)), f"{where}: {line}"
            if not line.startswith(("hlmtune ", "python ", "export ")):
                continue  # prose: not a command
            for cmd in line.split("&&"):
                argv = shlex.split(cmd, comments=True)
                if argv[:2] == ["hlmtune", "cp"]:
                    assert pack_file(argv[2]) is not None, f"{where}: {cmd}: no pack file {argv[2]}"
                    copied.add(argv[3])
                elif argv[:2] == ["hlmtune", "sweep"]:
                    checked += 1
                    if argv[2] == "status":
                        assert Path(argv[3]).parent.name == "runs" and Path(argv[3]).name in names, f"{where}: {cmd}"
                        continue
                    grid = pack_file(argv[2])
                    assert argv[2] in copied or (grid is not None and grid.name in pack_grids()), (
                        f"{where}: {cmd}: {argv[2]} is neither copied above nor a shipped grid")
                    unknown = [a for a in argv[3:] if a.startswith("-") and a not in flags]
                    assert not unknown, f"{where}: {cmd}: unknown flags {unknown}"
    assert checked >= 12
