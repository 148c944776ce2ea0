"""``hlmtune run`` as a newcomer uses it: copied recipes are validated, problems are one line
each before launch (exit 2, no traceback unless --debug), a failed rank is one error line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hlmtune.launch import CPU_RANKS_MEASURED
from recipe_runner import COLLECTOR, read_steps


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


# ------------------------------------------------------------------ CPU: ranks or threads
def _cfg(**kw):
    from omegaconf import OmegaConf

    base = {"device": "cpu", "batch_size": 4, "dtype": "fp32",
            "model": {"_component_": "torchtune.models.llama3.llama3", "vocab_size": 256, "num_layers": 2,
                      "num_heads": 4, "num_kv_heads": 2, "embed_dim": 64, "max_seq_len": 128}}
    base.update(kw)
    return OmegaConf.create(base)


def test_cpu_plan_splits_the_batch_over_one_rank_per_core():
    from hlmtune.launch import cpu_plan

    plan = cpu_plan(_cfg(), cores=2, env={}, mem_available=2**34)
    assert (plan.ranks, plan.batch_size) == (2, 2)  # the global batch stays 4
    assert plan.why.startswith("CPU: 2 ranks x 1 thread, batch_size 2 each (global 4")
    assert "1.03-1.11x" in plan.why and "--nproc_per_node 1" in plan.why
    six = cpu_plan(_cfg(batch_size=6), cores=4, env={}, mem_available=2**34)
    assert (six.ranks, six.batch_size) == (3, 2)  # the most ranks that split the batch evenly


@pytest.mark.parametrize("kw, env, cores, needle", [
    ({"batch_size": 3}, {}, 2, "batch_size 3 does not split over 2..2 ranks"),
    ({}, {"HLMTUNE_CPU_RANKS": "0"}, 2, "HLMTUNE_CPU_RANKS=0"),
    ({}, {"OMP_NUM_THREADS": "2"}, 2, "OMP_NUM_THREADS=2 threads as set"),
    ({}, {}, 1, "1 core"),
])
def test_cpu_plan_keeps_one_process_and_says_why(kw, env, cores, needle):
    from hlmtune.launch import cpu_plan

    plan = cpu_plan(_cfg(**kw), cores=cores, env=env, mem_available=2**34)
    assert plan.ranks == 1 and plan.batch_size == _cfg(**kw).batch_size
    assert plan.why.startswith("CPU: one process") and needle in plan.why, plan.why


def test_cpu_plan_keeps_one_process_when_model_copies_would_not_fit():
    from hlmtune.launch import cpu_plan
    from hlmtune.training.schema import build_model_on_meta

    cfg = _cfg()
    copy_bytes = build_model_on_meta(cfg.model, "fp32") * 4
    assert cpu_plan(cfg, cores=2, env={}, mem_available=4 * copy_bytes).ranks == 2  # a quarter: fits
    plan = cpu_plan(cfg, cores=2, env={}, mem_available=4 * copy_bytes - 1)
    assert plan.ranks == 1 and "1 more copies of the model would take" in plan.why


def test_cpu_plan_is_none_on_a_gpu_device():
    from hlmtune.launch import cpu_plan

    assert cpu_plan(_cfg(device="cuda"), cores=8, env={}) is None


def test_run_without_torchrun_options_on_cpu_starts_ranks(monkeypatch, tiny_model, text_data_dir):
    from hlmtune._cli_core import build_run_command

    monkeypatch.delenv("HLMTUNE_CPU_RANKS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    paths = [f"model_dir={tiny_model}", f"data_dir={text_data_dir}"]
    cmd = build_run_command(["lora_finetune_distributed", "--config", "tiny_lora", *paths])
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "2"] and cmd[-1] == "batch_size=2"
    one = build_run_command(["--nproc_per_node", "1", "lora_finetune_distributed", "--config", "tiny_lora", *paths])
    assert one[3:5] == ["--nproc_per_node", "1"] and "batch_size=2" not in one  # asked for: kept as given


@pytest.mark.slow
def test_cpu_ranks_keep_the_loss_curve_of_one_process(hlmtune_cli, copied, text_data_dir):
    args = ["run", "lora_finetune_distributed", "--config", "my.yaml", f"data_dir={text_data_dir}",
            "max_steps_per_epoch=4", "batch_size=4", f"metric_logger._component_={COLLECTOR}",
            "metric_logger.log_dir=${output_dir}/metrics"]
    ranks = _run(hlmtune_cli, *args, "output_dir=ranks", cwd=copied, env_drop=("HLMTUNE_CPU_RANKS", "OMP_NUM_THREADS"))
    assert ranks.returncode == 0, ranks.stderr
    line = [x for x in ranks.stderr.splitlines() if x.startswith("hlmtune run: CPU:")]
    n = max(d for d in (1, 2, 3, 4) if d <= len(os.sched_getaffinity(0)) and 4 % d == 0)  # ranks expected
    if n > 1:
        assert line == [f"hlmtune run: CPU: {n} ranks x 1 thread, batch_size {4 // n} each (global 4, as configured): "
                        f"{CPU_RANKS_MEASURED}; --nproc_per_node 1 or HLMTUNE_CPU_RANKS=0 runs one process"]
    one = _run(hlmtune_cli, *args, "output_dir=one", cwd=copied)  # the suite's HLMTUNE_CPU_RANKS=0
    assert one.returncode == 0 and "hlmtune run: CPU: one process, HLMTUNE_CPU_RANKS=0" in one.stderr, one.stderr
    a, b = read_steps(copied / "ranks"), read_steps(copied / "one")
    assert [s["memory_ranks"] for s in a] == [n] * 4 and [s["memory_ranks"] for s in b] == [1] * 4
    assert [s["loss"] for s in a] == pytest.approx([s["loss"] for s in b], rel=1e-5)
