"""``hlmtune run`` as a newcomer uses it: copied recipes are validated, problems are one line
each before launch (exit 2, no traceback unless --debug), a failed rank is one error line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


def _run(hlmtune_cli: str, *args: str, cwd: Path, env_drop=(), env_set=None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(env_set or {})
    return subprocess.run([hlmtune_cli, *args], capture_output=True, text=True, cwd=cwd, env=env)


@pytest.fixture
def copied(hlmtune_cli, tmp_path, tiny_model, text_data_dir):
    """The issue's workflow: `hlmtune cp` a recipe and a config, point the config at real files."""
    assert _run(hlmtune_cli, "cp", "lora_finetune_distributed", "my_lora.py", cwd=tmp_path).returncode == 0
    assert _run(hlmtune_cli, "cp", "tiny_lora", "my.yaml", cwd=tmp_path).returncode == 0
    cfg = tmp_path / "my.yaml"
    text = cfg.read_text().replace("model_dir: /tmp/hlmtune/tiny-llama3", f"model_dir: {tiny_model}")
    cfg.write_text(text.replace("output_dir: /tmp/hlmtune/runs/tiny_lora", f"output_dir: {tmp_path / 'out'}"))
    return tmp_path


def _one_line(err: str, needle: str) -> None:
    lines = [line for line in err.strip().splitlines() if line]
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert len(lines) == 1 and needle in lines[0], err


def test_copied_recipe_typo_is_one_line_before_launch(hlmtune_cli, copied, text_data_dir):
    proc = _run(hlmtune_cli, "run", "--nproc_per_node", "1", "./my_lora.py", "--config", "my.yaml",
                f"data_dir={text_data_dir}", "batch_sise=3", cwd=copied)
    assert proc.returncode == 2
    _one_line(proc.stderr, "unknown key 'batch_sise' for recipe lora_finetune_distributed (did you mean 'batch_size'?)")
    assert not (copied / "out").exists()


def test_missing_checkpoint_and_unset_variable_are_one_line_each(hlmtune_cli, copied, text_data_dir, tmp_path):
    missing = tmp_path / "no_such_model"
    proc = _run(hlmtune_cli, "run", "./my_lora.py", "--config", "my.yaml", f"data_dir={text_data_dir}",
                f"checkpointer.checkpoint_dir={missing}", cwd=copied)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"hlmtune run: key 'checkpointer.checkpoint_dir': {missing}: does not exist",
        f"hlmtune run: key 'checkpointer.checkpoint_files': {missing}/model.safetensors: does not exist",
    ], proc.stderr
    debug = _run(hlmtune_cli, "run", "--debug", "./my_lora.py", "--config", "my.yaml", f"data_dir={text_data_dir}",
                 f"checkpointer.checkpoint_dir={missing}", cwd=copied)
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "PreLaunchError" in debug.stderr
    unset = _run(hlmtune_cli, "run", "--nproc_per_node", "2", "./my_lora.py", "--config", "my.yaml", cwd=copied,
                 env_drop=("HLM_DATA",))
    assert unset.returncode == 2
    _one_line(unset.stderr, "key 'data_dir': ${oc.env:HLM_DATA}/text: environment variable HLM_DATA is not set")


def test_unknown_recipe_file_runs_with_a_warning(hlmtune_cli, copied, text_data_dir):
    script = copied / "hello.py"
    script.write_text("import sys\nprint('hello from', sys.argv[1:3])\n")
    proc = _run(hlmtune_cli, "run", "./hello.py", "--config", "my.yaml", f"data_dir={text_data_dir}",
                "not_a_key=1", cwd=copied)
    assert proc.returncode == 0, proc.stderr
    assert "hello.py declares no RecipeSpec" in proc.stderr and "not validated" in proc.stderr
    assert "hello from ['--config'" in proc.stdout


def _torchelastic_files(tmp: Path) -> list:
    """torchrun's per-run log trees in ``tmp``: (tree, files in it) each."""
    return [(d.name, sorted(str(f.relative_to(d)).split("/")[-1] for f in d.rglob("*") if f.is_file()))
            for d in sorted(tmp.glob("torchelastic_*"))]


def test_failed_rank_is_reported_by_its_error_line(hlmtune_cli, copied, text_data_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tmpdir")  # the runs' TMPDIR: torchrun puts its log trees there
    script = copied / "fails_on_rank1.py"
    script.write_text(
        "import os, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise RuntimeError('boom on rank 1')\n"
        "time.sleep(60)  # still running when rank 1 fails: torchrun stops it\n"
    )
    proc = _run(hlmtune_cli, "run", "--nproc_per_node", "2", "./fails_on_rank1.py", "--config", "my.yaml",
                f"data_dir={text_data_dir}", cwd=copied, env_set={"TMPDIR": str(tmp)})
    assert proc.returncode == 1, proc.stderr
    # The failed rank's error file is kept (with the folders above it); the empty rest is gone.
    trees = _torchelastic_files(tmp)
    assert len(trees) == 1 and trees[0][1] == ["error.json"], trees
    assert "hlmtune run: rank 1 failed (exit code 1): RuntimeError: boom on rank 1" in proc.stderr
    assert "hlmtune run: rank 0 stopped by torchrun after rank 1 failed" in proc.stderr
    assert "ChildFailedError" not in proc.stderr and "Root Cause" not in proc.stderr
    ok = copied / "ok.py"
    ok.write_text("print('fine')\n")
    proc = _run(hlmtune_cli, "run", "--nproc_per_node", "2", "./ok.py", "--config", "my.yaml",
                f"data_dir={text_data_dir}", cwd=copied, env_set={"TMPDIR": str(tmp)})
    assert proc.returncode == 0 and proc.stdout.count("fine") == 2, proc.stderr
    assert _torchelastic_files(tmp) == trees  # a run that left no file leaves no folder (torchrun: one per run)


def test_bad_data_row_is_one_line_from_the_rank(hlmtune_cli, copied, text_data_dir):
    """A truncated JSONL row: the builder's message (file, row, line) as one line per run, exit 2,
    under torchrun too; --debug keeps the traceback."""
    bad = copied / "bad_text"
    bad.mkdir()
    rows = (Path(text_data_dir) / "alpaca_cleaned.jsonl").read_text().splitlines()[:8]
    rows[3] = rows[3][: len(rows[3]) // 2]  # cut mid-row: not valid JSON
    (bad / "alpaca_cleaned.jsonl").write_text("\n".join(rows) + "\n")
    for launch in ([], ["--nproc_per_node", "2"]):
        proc = _run(hlmtune_cli, "run", *launch, "./my_lora.py", "--config", "my.yaml", f"data_dir={bad}",
                    "max_steps_per_epoch=1", cwd=copied)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "Failed to load JSON" not in proc.stderr, proc.stderr[-3000:]  # the reader's own record, muted
        errors = [ln for ln in proc.stderr.splitlines() if "error: dataset:" in ln]
        assert errors and "alpaca_cleaned.jsonl" in errors[0] and "line 4" in errors[0], proc.stderr[-3000:]
    debug = _run(hlmtune_cli, "run", "--debug", "./my_lora.py", "--config", "my.yaml", f"data_dir={bad}",
                 "max_steps_per_epoch=1", cwd=copied)
    assert debug.returncode != 0 and "Traceback" in debug.stderr
