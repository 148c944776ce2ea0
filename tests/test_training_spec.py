"""One spec per recipe: read from source, equal to the imported class's, the only source of
the registry, the accepted keys and the method label; a toy recipe added in one file runs."""

from __future__ import annotations

import importlib
import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from hlmtune import registry
from hlmtune.profiling.collector import infer_method
from hlmtune.training import schema
from hlmtune.training.spec import RecipeSpec, SpecError, discover_specs, method_for, pack_specs, read_spec

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(pack_specs()))
def test_imported_spec_equals_the_one_read_from_source(name):
    module = importlib.import_module(f"hlmtune.recipes.{name}")
    classes = [c for c in vars(module).values() if isinstance(c, type) and "SPEC" in vars(c)]
    assert len(classes) == 1, classes
    cls = classes[0]
    assert cls.SPEC == pack_specs()[name] == read_spec(ROOT / "recipes" / f"{name}.py")
    assert (cls.RECIPE, cls.METHOD) == (cls.SPEC.name, cls.SPEC.method)


def test_registry_keys_and_method_labels_derive_from_specs():
    specs = pack_specs()
    assert registry.RECIPES == {n: s.summary for n, s in specs.items()}
    for name, spec in specs.items():
        keys = schema.RECIPE_KEYS[name]
        assert keys == schema.TORCHTUNE_RECIPE_KEYS[spec.mirrors] | set(spec.adds) | set(spec.requires) | schema.PACK_KEYS
        assert infer_method(name, "llama3_8b") == spec.method
    assert "quantize" in schema.RECIPE_KEYS["qat_distributed"] and "quantize" not in schema.RECIPE_KEYS["lora_finetune_distributed"]


def test_method_for_torchtune_families():
    assert method_for("lora_finetune_single_device", "qlora_llama3_8b") == "qlora"
    assert method_for("lora_finetune_single_device", "lora_llama3_8b") == "lora"
    assert method_for("lora_dpo_single_device", "qlora_llama3_8b") == "qlora_dpo"
    assert method_for("qat_lora_finetune_distributed", "lora_llama3_8b") == "qat_lora"  # longest prefix wins
    assert method_for("qat_single_device", None) == "qat"
    assert method_for("full_dpo_distributed", None) == "full_dpo"
    assert method_for("knowledge_distillation_distributed", None) == "kd"
    assert method_for("my_recipe", None) == "my_recipe" and method_for(None, "x") is None
    assert pack_specs()["lora_finetune_distributed"].method_label("m.lora_llama3", quantize_base=True) == "qlora"


def test_copies_subclasses_and_files_without_a_spec(tmp_path):
    src = (ROOT / "recipes" / "qat_distributed.py").read_text()
    copy = tmp_path / "my_qat.py"
    copy.write_text(src)
    assert read_spec(copy) == pack_specs()["qat_distributed"]  # a copy keeps its spec, any name
    assert registry.resolve_recipe(str(copy)).spec == pack_specs()["qat_distributed"]
    sub = tmp_path / "sub.py"
    sub.write_text("from hlmtune.recipes.lora_finetune_distributed import LoRAFinetuneRecipeDistributed as L\n"
                   "class Mine(L):\n    pass\n")
    assert read_spec(sub) == pack_specs()["lora_finetune_distributed"]
    plain = tmp_path / "plain.py"
    plain.write_text("print('hi')\n")
    assert read_spec(plain) is None and not registry.resolve_recipe(str(plain)).pack
    bad = tmp_path / "bad.py"
    bad.write_text("NAME = 'x'\nclass R:\n    SPEC = RecipeSpec(name=NAME, method='m', mirrors='qat_distributed', summary='s')\n")
    with pytest.raises(SpecError, match="literal"):
        read_spec(bad)
    bad.write_text("class R:\n    SPEC = RecipeSpec(name='x', method='m', mirors='qat_distributed', summary='s')\n")
    with pytest.raises(SpecError, match="no field 'mirors'"):
        read_spec(bad)


def test_discovery_requires_a_spec_named_like_the_file(tmp_path):
    (tmp_path / "one.py").write_text(
        "class R:\n    SPEC = RecipeSpec(name='one', method='m', mirrors='full_finetune_distributed', summary='s')\n")
    assert discover_specs(tmp_path)["one"] == RecipeSpec(name="one", method="m", mirrors="full_finetune_distributed", summary="s")
    (tmp_path / "two.py").write_text(
        "class R:\n    SPEC = RecipeSpec(name='deux', method='m', mirrors='full_finetune_distributed', summary='s')\n")
    with pytest.raises(SpecError, match="must be the file name"):
        discover_specs(tmp_path)
    (tmp_path / "two.py").write_text("x = 1\n")
    with pytest.raises(SpecError, match="must declare SPEC"):
        discover_specs(tmp_path)


def test_spec_keys_drive_validation(monkeypatch, tmp_path):
    from hlmtune.compat import load_config

    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    cfg = load_config(str(registry.config_path("tiny_full")), ["toy_scale=2.0"])
    toy = RecipeSpec(name="toy", method="toy", mirrors="full_finetune_distributed", summary="s", adds=("toy_scale",))
    schema.validate_config(cfg, toy)
    with pytest.raises(schema.ConfigError, match="unknown key 'toy_scale'"):
        schema.validate_config(cfg, "full_finetune_distributed")
    strict = RecipeSpec(name="toy", method="toy", mirrors="full_finetune_distributed", summary="s", requires=("toy_needed",))
    with pytest.raises(schema.ConfigError, match="missing required key 'toy_needed'"):
        schema.validate_config(cfg, strict)
    with pytest.raises(schema.ConfigError, match="mirrors 'full_finetune_distribute'"):
        schema.validate_config(cfg, RecipeSpec(name="t", method="t", mirrors="full_finetune_distribute", summary="s"))


TOY_RECIPE = '''
"""A toy recipe: full fine-tuning that also logs a constant from its own config key."""

import sys

import torch
from omegaconf import DictConfig
from torchtune import config

from hlmtune.training.recipe import SFTRecipe
from hlmtune.training.spec import RecipeSpec


class ToyRecipe(SFTRecipe):
    SPEC = RecipeSpec(
        name="toy_finetune",
        method="toy",
        mirrors="full_finetune_distributed",
        summary="full fine-tuning that logs toy/scale",
        adds=("toy_scale",),
        requires=("toy_scale",),
    )

    def train_step(self, batch):
        out = super().train_step(batch)
        out["toy/scale"] = torch.tensor(float(self._cfg.toy_scale))
        return out


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = ToyRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
'''


@pytest.mark.slow
def test_toy_recipe_in_one_file_validates_and_runs(tiny_model, text_data_dir, tmp_path, hlmtune_cli):
    """docs/ARCHITECTURE.md "Adding a recipe": one file with a SPEC, run on a pack config."""
    recipe = tmp_path / "toy_finetune.py"
    recipe.write_text(textwrap.dedent(TOY_RECIPE))
    out = tmp_path / "run"
    base = [hlmtune_cli, "run", str(recipe), "--config", "tiny_full", f"model_dir={tiny_model}",
            f"data_dir={text_data_dir}", f"output_dir={out}", "max_steps_per_epoch=2", "batch_size=2",
            "metric_logger._component_=hlmtune.profiling.collector.CollectorLogger", f"metric_logger.log_dir={out}/metrics"]
    typo = subprocess.run([*base, "toy_scale=3.5", "toy_sacle=1"], capture_output=True, text=True)
    assert typo.returncode == 2 and "unknown key 'toy_sacle'" in typo.stderr and "did you mean 'toy_scale'" in typo.stderr
    missing = subprocess.run(base, capture_output=True, text=True)
    assert missing.returncode == 2 and "missing required key 'toy_scale'" in missing.stderr
    assert "Traceback" not in typo.stderr + missing.stderr
    proc = subprocess.run([*base, "toy_scale=3.5"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics" / "steps.jsonl").read_text().splitlines() if line.strip()]
    assert [s["toy/scale"] for s in steps] == [3.5, 3.5]
    run = json.loads((out / "metrics" / "run.json").read_text())
    assert run["recipe"] == "toy_finetune" and run["method"] == "toy"
