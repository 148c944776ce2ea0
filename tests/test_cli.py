"""``hlmtune`` core subcommands: ls, cp, path, run (command building, validation), demo args."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hlmtune._cli_core import build_run_command, split_run_args
from hlmtune.cli import main
from hlmtune.registry import CONFIGS, RECIPES

HLMTUNE = str(Path(sys.executable).with_name("hlmtune"))


def test_ls_lists_every_recipe_and_config(capsys):
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    for r in RECIPES:
        assert r in out
    for c in CONFIGS:
        assert c in out
    assert "tune ls" in out


def test_cp_copies_config_and_respects_no_clobber(tmp_path, capsys):
    dest = tmp_path / "a" / "mine"
    assert main(["cp", "tiny_lora", str(dest)]) == 2  # parent missing
    assert "--make-parents" in capsys.readouterr().err
    assert main(["cp", "tiny_lora", str(dest), "--make-parents"]) == 0
    copied = dest.with_suffix(".yaml")
    assert copied.read_text() == (Path(__file__).parent.parent / "configs" / "tiny_lora.yaml").read_text()
    copied.write_text("mine")
    assert main(["cp", "tiny_lora", str(copied), "--no-clobber"]) == 0
    assert copied.read_text() == "mine"
    assert main(["cp", "lora_finetune_distributed", str(tmp_path)]) == 0
    assert (tmp_path / "lora_finetune_distributed.py").exists()
    assert main(["cp", "no_such_thing", str(tmp_path)]) == 2


def test_path_points_at_installed_files(capsys):
    assert main(["path", "tiny_lora"]) == 0
    p = Path(capsys.readouterr().out.strip())
    assert p.name == "tiny_lora.yaml" and p.exists()
    assert main(["path", "lora_dpo_distributed"]) == 0
    assert Path(capsys.readouterr().out.strip()).name == "lora_dpo_distributed.py"


def test_split_run_args_separates_torchrun_flags():
    flags, recipe, rest, ns = split_run_args(
        ["--nnodes", "2", "--nproc_per_node", "4", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:29500",
         "lora_finetune_distributed", "--config", "x.yaml", "batch_size=2"])
    assert flags == ["--nnodes", "2", "--nproc_per_node", "4", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:29500"]
    assert recipe == "lora_finetune_distributed"
    assert rest == ["--config", "x.yaml", "batch_size=2"]
    assert ns.rdzv_endpoint == "h:29500"


def test_build_run_command_pack_recipe(tiny_model, text_data_dir):
    paths = [f"model_dir={tiny_model}", f"data_dir={text_data_dir}"]
    single = build_run_command(["lora_finetune_distributed", "--config", "tiny_lora", *paths, "batch_size=2"])
    assert single[1:3] == ["-m", "hlmtune.recipes.lora_finetune_distributed"]
    assert single[4].endswith("tiny_lora.yaml") and single[-1] == "batch_size=2"
    # argparse's other spelling, which torchtune's config.parse accepts too
    assert build_run_command(["lora_finetune_distributed", "--config=tiny_lora", *paths, "batch_size=2"]) == single
    multi = build_run_command(["--nproc_per_node", "2", "lora_finetune_distributed", "--config", "tiny_lora", *paths])
    assert multi[1:3] == ["-m", "torch.distributed.run"]
    assert "--standalone" in multi  # as tune run: no rendezvous endpoint -> standalone
    # Each rank runs the recipe through hlmtune._rank, which records its error for the summary.
    i = multi.index("hlmtune._rank")
    assert multi[i - 1:i + 3] == ["-m", "hlmtune._rank", "-m", "hlmtune.recipes.lora_finetune_distributed"]
    rdzv = build_run_command(["--nnodes", "2", "--rdzv_endpoint", "h:1", "--rdzv_backend", "c10d",
                              "lora_finetune_distributed", "--config", "tiny_lora", *paths])
    assert "--standalone" not in rdzv


def test_build_run_command_torchtune_builtin_recipe(monkeypatch):
    from hlmtune.launch import PreLaunchError

    argv = ["lora_finetune_single_device", "--config", "llama3/8B_lora_single_device"]
    with pytest.raises(PreLaunchError, match="key 'checkpointer.checkpoint_dir': /tmp/Meta-Llama-3-8B-Instruct"):
        build_run_command(argv)  # torchtune's config names a model folder that is not here
    monkeypatch.setattr("hlmtune.preflight.path_problems", lambda data: [])
    cmd = build_run_command(argv)
    assert cmd[1].endswith("lora_finetune_single_device.py")
    assert cmd[3].endswith("8B_lora_single_device.yaml")


def test_run_rejects_typos_unknown_recipes_and_missing_config(tiny_model, text_data_dir, capsys):
    paths = [f"model_dir={tiny_model}", f"data_dir={text_data_dir}"]
    assert main(["run", "lora_finetune_distributed", "--config", "tiny_lora", *paths, "optimizer.lrr=1"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err
    assert main(["run", "lora_finetune_distributd", "--config", "tiny_lora"]) == 2
    assert "did you mean 'lora_finetune_distributed'" in capsys.readouterr().err
    assert main(["run", "lora_finetune_distributed"]) == 2
    assert "--config" in capsys.readouterr().err
    assert main(["run", "lora_finetune_distributed", "--config", "tiny_lorra"]) == 2
    assert "did you mean 'tiny_lora'" in capsys.readouterr().err


def test_run_help_and_top_level_help():
    out = subprocess.run([HLMTUNE, "run", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--nproc_per_node" in out.stdout and "tune run hlmtune/recipes" in out.stdout
    out = subprocess.run([HLMTUNE, "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("ls", "cp", "run", "validate", "demo", "scaling-demo", "eval", "collect", "tokenize"):
        assert cmd in out.stdout


def test_validate_cli(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    assert main(["validate", "--config", "tiny_lora"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["validate", "--config", "tiny_lora", "data_loader.num_workerz=2"]) == 2
    assert "did you mean 'data_loader.num_workers'" in capsys.readouterr().err
    assert main(["validate", "--config", "tiny_lora", "--check-paths", f"model_dir={tmp_path}"]) == 2
    assert "tokenizer.path" in capsys.readouterr().err
    # a copy under another name (`hlmtune cp tiny_lora my_run.yaml`): its header names the recipe
    copy = tmp_path / "my_run.yaml"
    copy.write_text((Path(__file__).resolve().parents[1] / "configs" / "tiny_lora.yaml").read_text())
    assert main(["validate", "--config", str(copy)]) == 0
    out, err = capsys.readouterr()
    assert "valid for lora_finetune_distributed" in out and "named by the launch command" in err
    copy.write_text("seed: 0\n")  # no header: the recipe must be named
    assert main(["validate", "--config", str(copy)]) == 2
    assert "name the recipe for" in capsys.readouterr().err


def test_validate_an_ecg_config_before_its_tokens_exist(tmp_path, capsys):
    """The model's vocabulary comes from the token manifest: before `hlmtune tokenize`, the config is
    still checked (a warning names the missing manifest); with --check-paths it is an error. One line, no traceback."""
    where = f"shards_dir={tmp_path / 'no_tokens'}"
    assert main(["validate", "lora_finetune_distributed", "--config", "ecg_lora", where]) == 0
    out, err = capsys.readouterr()
    assert "OK" in out and "not built" in out and "Traceback" not in err
    assert "warning: model not built" in err and "hlmtune tokenize" in err and str(tmp_path / "no_tokens") in err
    assert main(["validate", "lora_finetune_distributed", "--config", "ecg_lora", where, "dataset.num_exampels=5"]) == 2
    assert "num_examples" in capsys.readouterr().err  # a typo is still found
    assert main(["validate", "lora_finetune_distributed", "--config", "ecg_lora", where, "--check-paths"]) == 2
    err = capsys.readouterr().err
    assert f"key 'shards_dir': {tmp_path / 'no_tokens'}" in err and "Traceback" not in err


def test_scaling_demo_without_data_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("HLM_DATA", raising=False)
    assert main(["scaling-demo", "--out", str(tmp_path)]) == 2
    assert "HLM_DATA" in capsys.readouterr().err


def test_run_rejects_process_counts_below_one(capsys, monkeypatch):
    """torchrun itself asserts (a bare AssertionError page); the flag is named before launch."""
    import os

    monkeypatch.setattr(os, "execv", lambda *a: (_ for _ in ()).throw(AssertionError(f"launched {a}")))
    for flags in (["--nproc_per_node", "0"], ["--nnodes", "0:2", "--nproc_per_node", "2"]):
        assert main(["run", *flags, "lora_finetune_distributed", "--config", "tiny_lora"]) == 2
        err = capsys.readouterr().err
        assert f"{flags[0]} {flags[1]}: needs at least 1" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


def test_yaml_syntax_error_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: 2\nmodel: [1, 2\nseed: 3\n")
    for cmd in (["run", "lora_finetune_distributed"], ["validate", "lora_finetune_distributed"]):
        proc = subprocess.run([HLMTUNE, *cmd, "--config", str(bad)], capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert f"{bad}: YAML syntax error at line 3" in proc.stderr and "flow sequence at line 2" in proc.stderr and "fix the file" in proc.stderr


def test_scaling_demo_into_a_file_is_one_line_exit_2(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("x")
    data = tmp_path / "alpaca.jsonl"
    data.write_text('{"instruction": "a", "input": "", "output": "b"}\n')
    assert main(["scaling-demo", "--out", str(taken), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"--out {taken}: is a file, not a directory" in err and len(err.strip().splitlines()) == 1


def test_run_names_a_bad_count_a_missing_recipe_and_a_bare_call(capsys, monkeypatch, tmp_path):
    """One `hlmtune run:` line each, exit 2, no torchrun usage page and nothing launched."""
    import os

    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    monkeypatch.setattr(os, "execv", lambda *a: (_ for _ in ()).throw(AssertionError(f"launched {a}")))
    cases = [
        (["--nproc_per_node", "two", "lora_finetune_distributed", "--config", "tiny_lora"],
         "--nproc_per_node two: not a count (an integer, or auto / cpu / gpu / xpu)"),
        (["--nnodes", "x", "lora_finetune_distributed", "--config", "tiny_lora"], "--nnodes x: not a count"),
        (["--config", "tiny_lora"], "name the recipe before --config"),
        (["--nproc_per_node", "2", "--config", "tiny_lora"], "name the recipe before --config"),
        (["--bogus", "lora_finetune_distributed", "--config", "tiny_lora"], "unrecognized arguments: --bogus"),
    ]
    for argv, needle in cases:
        assert main(["run", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("hlmtune run: ") and needle in err, err
    # a copy under another name: its header's launch command is named
    copy = tmp_path / "my_run.yaml"
    copy.write_text((Path(__file__).resolve().parents[1] / "configs" / "tiny_lora.yaml").read_text())
    assert main(["run", "--config", str(copy)]) == 2
    assert f"{copy}'s header launches it with lora_finetune_distributed" in capsys.readouterr().err
    assert main(["run", f"--config={copy}"]) == 2
    assert f"{copy}'s header launches it with lora_finetune_distributed" in capsys.readouterr().err
    assert main(["run", "lora_finetune_distributed", "--config="]) == 2  # a name, not an empty one
    assert "--config argument is required" in capsys.readouterr().err
    assert main(["run"]) == 2  # bare: the help, on stderr, as an error
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: hlmtune run")
    assert main(["run", "--help"]) == 0 and capsys.readouterr().out.startswith("usage: hlmtune run")


def test_validate_and_run_list_key_and_path_problems_in_one_pass(capsys, monkeypatch, tmp_path):
    """A typo and a missing folder together: both named, keys first, by validate --check-paths and run."""
    import os

    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    monkeypatch.setattr(os, "execv", lambda *a: (_ for _ in ()).throw(AssertionError(f"launched {a}")))
    missing = tmp_path / "no_model"
    args = ["--config", "tiny_lora", f"model_dir={missing}", "batch_sise=2"]
    assert main(["validate", "--check-paths", *args]) == 2
    v = capsys.readouterr().err.splitlines()
    assert main(["run", "lora_finetune_distributed", *args]) == 2
    r = capsys.readouterr().err.splitlines()
    for lines in (v, r):
        assert "did you mean 'batch_size'" in lines[0], lines
        assert any(f"key 'model_dir': {missing}: does not exist" in ln for ln in lines[1:]), lines


def test_cp_and_path_name_the_closest_pack_file(tmp_path, capsys):
    for cmd in (["cp", "tiny_lra", str(tmp_path / "x.yaml")], ["path", "tiny_lra"], ["path", "ecg_paper_swep.yaml"]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert ("did you mean 'tiny_lora'?" if "tiny_lra" in cmd else "did you mean 'ecg_paper_sweep.yaml'?") in err, err
    assert not (tmp_path / "x.yaml").exists()
    assert main(["path", "zzzzqqq"]) == 2 and "did you mean" not in capsys.readouterr().err


def _all_parsers(parser, name="hlmtune"):
    import argparse

    yield name, parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, p in a.choices.items():
                yield from _all_parsers(p, f"{name} {sub}")


def test_every_option_states_its_default_at_most_once_and_shows_zero():
    """argparse's ArgumentDefaultsHelpFormatter appended "(default: None)" after help that already
    said its default; the pack's formatter does not, and shows a default of 0 (0 == False)."""
    from hlmtune.cli import build_parser

    seen = 0
    for name, p in _all_parsers(build_parser()):
        fmt = p._get_formatter()
        for a in p._actions:
            if not a.help or not a.option_strings:
                continue
            text = fmt._get_help_string(a)
            seen += 1
            assert text.replace("%(default)s", "").count("default") <= 1, f"{name} {a.option_strings[0]}: {text}"
            assert "(default: %(default)s)" not in text or a.default not in (None, [], ()), f"{name} {a.option_strings[0]}"
    assert seen > 100
    synth = dict(_all_parsers(build_parser()))["hlmtune synth-ecg"]
    assert "--seed SEED" in synth.format_help() and "(default: 0)" in synth.format_help()
