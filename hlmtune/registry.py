"""The pack's recipes and configs, and which recipe each config is for.

Names resolve pack-first: ``hlmtune run lora_finetune_distributed`` is the pack's recipe
(torchtune has a recipe of the same name; ours wins, theirs stays reachable through
``tune run``). Every YAML under ``configs/`` must be listed here (a test checks both ways).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional

RECIPES: Dict[str, str] = {
    "lora_finetune_distributed": "LoRA and QLoRA (NF4 base) fine-tuning",
    "full_finetune_distributed": "full fine-tuning; trains from scratch without a checkpointer (ECG model)",
    "lora_dpo_distributed": "DPO with LoRA adapters; the frozen base is the reference model",
    "full_dpo_distributed": "DPO of all weights against a separate frozen reference model",
    "qat_distributed": "quantization-aware full fine-tuning, then int8-activation/int4-weight quantization",
    "qat_lora_finetune_distributed": "QAT with LoRA adapters, then quantization of the merged model",
}

# Llama3-8B configs: method x instruction/summarization/grammar dataset.
_SFT_DATASETS = ("alpaca", "grammar", "samsum", "slimorca")
_PREF_DATASETS = ("stack_exchange", "hh_rlhf")

CONFIGS: Dict[str, str] = {}
for _ds in _SFT_DATASETS:
    CONFIGS[f"llama3_8b_lora_{_ds}"] = "lora_finetune_distributed"
    CONFIGS[f"llama3_8b_qlora_{_ds}"] = "lora_finetune_distributed"
    CONFIGS[f"llama3_8b_qat_{_ds}"] = "qat_distributed"
    CONFIGS[f"llama3_8b_qat_lora_{_ds}"] = "qat_lora_finetune_distributed"
for _ds in _PREF_DATASETS:
    CONFIGS[f"llama3_8b_lora_dpo_{_ds}"] = "lora_dpo_distributed"
# Tiny 2-layer Llama3 configs: tests, the demo and benchmarks (`model_dir=` made by
# `hlmtune.tiny.write_tiny_assets`, `data_dir=` pointing at local JSONL samples).
CONFIGS.update(
    {
        "tiny_lora": "lora_finetune_distributed",
        "tiny_qlora": "lora_finetune_distributed",
        "tiny_full": "full_finetune_distributed",
        "tiny_lora_dpo": "lora_dpo_distributed",
        "tiny_full_dpo": "full_dpo_distributed",
        "tiny_qat": "qat_distributed",
        "tiny_qat_lora": "qat_lora_finetune_distributed",
    }
)


@dataclass(frozen=True)
class ResolvedRecipe:
    """How to launch a recipe.

    Attributes:
        name (str): what the user typed.
        module (Optional[str]): module to run with ``python -m`` (pack recipes).
        path (Optional[Path]): script to run (torchtune built-ins, user files).
        pack (bool): one of the pack's recipes (its config keys are validated up front).
    """

    name: str
    module: Optional[str]
    path: Optional[Path]
    pack: bool


def configs_dir() -> Path:
    """Folder holding the pack's YAML configs (installed as ``hlmtune.configs``)."""
    return Path(str(resources.files("hlmtune.configs")))


def recipes_dir() -> Path:
    """Folder holding the pack's recipe files (installed as ``hlmtune.recipes``)."""
    return Path(str(resources.files("hlmtune.recipes")))


def config_path(name: str) -> Optional[Path]:
    """Path of a pack config by name (with or without ``.yaml``), or None."""
    stem = name[:-5] if name.endswith(".yaml") else name
    if stem in CONFIGS:
        p = configs_dir() / f"{stem}.yaml"
        return p if p.exists() else None
    return None


def recipe_for_config(name: str) -> Optional[str]:
    """The pack recipe a pack config is for, or None for other configs."""
    stem = Path(name).name
    stem = stem[:-5] if stem.endswith(".yaml") else stem
    return CONFIGS.get(stem)


def resolve_recipe(name: str) -> ResolvedRecipe:
    """Pack recipe name, then a ``.py`` path, then a torchtune built-in recipe name.

    Args:
        name (str): recipe name or path.

    Returns:
        ResolvedRecipe: how to launch it.

    Raises:
        ValueError: nothing of that name (message lists the pack's recipes).
    """
    stem = name[:-3] if name.endswith(".py") else name
    if Path(stem).name in RECIPES and not Path(name).is_file():
        return ResolvedRecipe(name, f"hlmtune.recipes.{Path(stem).name}", None, True)
    if name.endswith(".py") and Path(name).is_file():
        p = Path(name).resolve()
        # A copy of a pack recipe (from `hlmtune cp`) keeps the pack's key checks.
        return ResolvedRecipe(name, None, p, p.stem in RECIPES)
    from hlmtune._compat import builtin_recipes

    recipes, root = builtin_recipes()
    for r in recipes:
        if r.name == name:
            return ResolvedRecipe(name, None, root / r.file_path, False)
    import difflib

    close = difflib.get_close_matches(name, list(RECIPES) + [r.name for r in recipes], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ValueError(
        f"unknown recipe '{name}'{hint}. Pack recipes: {', '.join(RECIPES)}; "
        "torchtune's: `tune ls`; or give a path to a .py recipe file"
    )


def resolve_config(name: str) -> Path:
    """Pack config name, then a file path, then a torchtune built-in config name.

    Raises:
        FileNotFoundError: nothing of that name.
    """
    p = config_path(name)
    if p is not None:
        return p
    if Path(name).is_file():
        return Path(name).resolve()
    from hlmtune._compat import builtin_recipes

    recipes, root = builtin_recipes()
    for r in recipes:
        for c in r.configs:
            if c.name == name:
                return root / "configs" / c.file_path
    import difflib

    close = difflib.get_close_matches(Path(name).stem, list(CONFIGS), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise FileNotFoundError(f"no config '{name}'{hint}: not a pack config (`hlmtune ls`), a file, or a torchtune config (`tune ls`)")


def list_pack() -> List[tuple]:
    """(recipe, description, [configs]) for ``hlmtune ls``."""
    return [(r, d, sorted(c for c, rr in CONFIGS.items() if rr == r)) for r, d in RECIPES.items()]
