"""The pack's recipes and configs, and which recipe each config is for.

Names resolve pack-first: ``hlmtune run lora_finetune_distributed`` is the pack's recipe
(torchtune has a recipe of the same name; ours wins, theirs stays reachable through
``tune run``). The recipes are the files under ``recipes/``, each declaring its
``RecipeSpec``; every YAML under ``configs/`` must be listed in ``CONFIGS`` (a test checks
both ways).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional

from hlmtune.training.spec import RecipeSpec, SpecError, pack_recipes_dir, pack_specs, read_spec

# Recipe name -> one-line summary, from each recipe class's SPEC (hlmtune.training.spec).
RECIPES: Dict[str, str] = {name: spec.summary for name, spec in pack_specs().items()}

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
# The Heart Language Model (hlmtune.hlm): pretraining from scratch, then fine-tuning for
# beat classes from the pretrained weights.
CONFIGS.update(
    {
        "ecg_pretrain": "full_finetune_distributed",
        "ecg_lora": "lora_finetune_distributed",
        "ecg_qlora": "lora_finetune_distributed",
        "ecg_dpo": "lora_dpo_distributed",
        "ecg_qat": "qat_distributed",
    }
)


@dataclass(frozen=True)
class ResolvedRecipe:
    """How to launch a recipe.

    Attributes:
        name (str): what the user typed.
        module (Optional[str]): module to run with ``python -m`` (pack recipes).
        path (Optional[Path]): script to run (torchtune built-ins, user files).
        spec (Optional[RecipeSpec]): what the recipe declares (pack recipes, their copies
            and subclasses, user recipes with a ``SPEC``); None for torchtune's built-ins and
            recipe files of unknown kind, which are not validated before launch.
    """

    name: str
    module: Optional[str]
    path: Optional[Path]
    spec: Optional[RecipeSpec]

    @property
    def pack(self) -> bool:
        """The config is validated before launch (the recipe declares a spec)."""
        return self.spec is not None


def configs_dir() -> Path:
    """Folder holding the pack's YAML configs (installed as ``hlmtune.configs``)."""
    return Path(str(resources.files("hlmtune.configs")))


def recipes_dir() -> Path:
    """Folder holding the pack's recipe files (installed as ``hlmtune.recipes``)."""
    return pack_recipes_dir()


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


def recipe_in_header(path: Path) -> Optional[str]:
    """The pack recipe a config's header launches it with, or None.

    Every pack config opens with comment lines naming its launch command (``hlmtune run ...
    lora_finetune_distributed --config ecg_lora``), and a copy (``hlmtune cp``) keeps them, so a
    copy under another name still says which recipe it is for. Only the leading comment block is
    read, and only a single recipe counts: a header naming two is ambiguous.

    Args:
        path (Path): a YAML config.

    Returns:
        Optional[str]: the one pack recipe the header's ``hlmtune run`` lines name, else None.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    named = set()
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            break  # the header ends at the first setting
        words = line.lstrip("# \t").split()
        if words[:2] == ["hlmtune", "run"]:
            named.update(w for w in words[2:] if w in RECIPES)
    return named.pop() if len(named) == 1 else None


def resolve_recipe(name: str) -> ResolvedRecipe:
    """Pack recipe name, then a ``.py`` path, then a torchtune built-in recipe name.

    Args:
        name (str): recipe name or path.

    Returns:
        ResolvedRecipe: how to launch it.

    A ``.py`` file is recognised by the ``SPEC`` its recipe class declares (read from the
    source, see ``hlmtune.training.spec.read_spec``): a copy of a pack recipe keeps the
    pack recipe's spec whatever the file is called.

    Raises:
        ValueError: nothing of that name (message lists the pack's recipes), or a recipe
            file whose ``SPEC`` cannot be read.
    """
    stem = name[:-3] if name.endswith(".py") else name
    specs = pack_specs()
    if Path(stem).name in specs and not Path(name).is_file():
        return ResolvedRecipe(name, f"hlmtune.recipes.{Path(stem).name}", None, specs[Path(stem).name])
    if name.endswith(".py") and Path(name).is_file():
        p = Path(name).resolve()
        try:
            return ResolvedRecipe(name, None, p, read_spec(p))
        except SpecError as e:
            raise ValueError(str(e)) from None
    from hlmtune.compat import builtin_recipes

    recipes, root = builtin_recipes()
    for r in recipes:
        if r.name == name:
            return ResolvedRecipe(name, None, root / r.file_path, None)
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
    from hlmtune.compat import builtin_recipes

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
