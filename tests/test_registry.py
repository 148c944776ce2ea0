"""Recipe/config name resolution, pack first, then files, then torchtune's."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlmtune.registry import CONFIGS, RECIPES, configs_dir, recipe_for_config, recipes_dir, resolve_config, resolve_recipe

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
