"""Recipe/config name resolution, pack first, then files, then torchtune's."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlmtune.registry import (CONFIGS, RECIPES, configs_dir, recipe_for_config, recipe_in_header, recipes_dir, resolve_config,
                              resolve_recipe)

ROOT = Path(__file__).resolve().parent.parent


def test_every_recipe_file_exists_and_is_registered():
    files = {p.stem for p in (ROOT / "recipes").glob("*.py") if not p.name.startswith("_")}
    assert files == set(RECIPES)
    assert recipes_dir().resolve() == (ROOT / "recipes").resolve()
    assert configs_dir().resolve() == (ROOT / "configs").resolve()


def test_pack_names_win_over_torchtune():
    r = resolve_recipe("lora_finetune_distributed")
    assert r.pack and r.module == "hlmtune.recipes.lora_finetune_distributed"
    tt = resolve_recipe("lora_finetune_single_device")
    assert not tt.pack and tt.path.name == "lora_finetune_single_device.py"


def test_recipe_file_path_and_copies(tmp_path):
    copy = tmp_path / "my_qat.py"  # any name: the class's SPEC says what it is
    copy.write_text((ROOT / "recipes" / "qat_distributed.py").read_text())
    r = resolve_recipe(str(copy))
    assert r.path == copy.resolve() and r.pack and r.spec.name == "qat_distributed"
    unknown = tmp_path / "qat_distributed.py"  # a pack name but no spec: not validated
    unknown.write_text("print('mine')\n")
    assert not resolve_recipe(str(unknown)).pack


def test_config_resolution(tmp_path):
    assert resolve_config("tiny_lora").name == "tiny_lora.yaml"
    assert resolve_config("tiny_lora.yaml").name == "tiny_lora.yaml"
    f = tmp_path / "x.yaml"
    f.write_text("a: 1\n")
    assert resolve_config(str(f)) == f.resolve()
    assert resolve_config("llama3/8B_lora").name == "8B_lora.yaml"
    with pytest.raises(FileNotFoundError, match="did you mean"):
        resolve_config("tiny_lroa")
    assert recipe_for_config("tiny_qat") == "qat_distributed"
    assert recipe_for_config("/some/where/tiny_qat.yaml") == "qat_distributed"
    assert set(CONFIGS.values()) <= set(RECIPES)


def test_a_config_header_names_the_recipe_it_is_for(tmp_path):
    """Every shipped header launches its config with the recipe the registry maps it to; a copy keeps it."""
    for name, recipe in CONFIGS.items():
        assert recipe_in_header(configs_dir() / f"{name}.yaml") == recipe, name
    text = (configs_dir() / "ecg_lora.yaml").read_text()
    copy = tmp_path / "my_run.yaml"
    copy.write_text(text)
    assert recipe_in_header(copy) == "lora_finetune_distributed"
    # two recipes named: ambiguous
    copy.write_text("# hlmtune run qat_distributed --config x\n" + text)
    assert recipe_in_header(copy) is None
    # only the leading comment block counts
    copy.write_text("seed: 0\n# hlmtune run qat_distributed --config x\n")
    assert recipe_in_header(copy) is None
    # a torchtune launch line or an unknown name is not a pack recipe
    copy.write_text("#   tune run lora_finetune_distributed --config x\n# hlmtune run my_recipe --config x\nseed: 0\n")
    assert recipe_in_header(copy) is None
    assert recipe_in_header(tmp_path / "absent.yaml") is None
