"""One declaration per recipe: what it is called, what it mirrors, which keys it adds.

Every recipe class declares a :class:`RecipeSpec` as its ``SPEC`` class attribute, written
with literal arguments only. The registry (``hlmtune ls``, name resolution), config
validation (accepted and required keys) and the collector's method label are all derived
from these declarations, so adding a recipe is one file under ``recipes/`` plus its configs.

The declarations are read from the recipe files' source with :mod:`ast` (no import): the
recipe modules import torch and torchtune, which ``hlmtune --help``, ``hlmtune ls`` and the
pre-launch checks of ``hlmtune run`` should not pay for. Reading the source also lets
``hlmtune run ./my_recipe.py`` recognise a copied or user-written recipe before launching
it: a copy keeps its ``SPEC`` (validated as the pack recipe it was copied from), a subclass
of a pack recipe inherits the parent's, and a new ``SPEC`` declares its own keys.
A test imports every pack recipe and checks that the imported ``SPEC`` equals the one read
from source.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class RecipeSpec:
    """What a recipe is, for the registry, validation and metrics.

    Attributes:
        name (str): registry name (the file stem for pack recipes), e.g.
            ``lora_finetune_distributed``; also recorded in resumable checkpoints.
        method (str): method label in metrics (``lora``, ``full``, ``qat`` ...).
        mirrors (str): the torchtune 0.6.1 recipe whose config keys it accepts (a key of
            ``hlmtune.training.schema.TORCHTUNE_RECIPE_KEYS``).
        summary (str): one line for ``hlmtune ls``.
        adds (Tuple[str, ...]): top-level config keys beyond the mirrored recipe's and the
            pack's own (``hlmtune.training.schema.PACK_KEYS``).
        requires (Tuple[str, ...]): keys it cannot run without, beyond the ones every
            recipe needs (``hlmtune.training.schema.REQUIRED_KEYS``).
        nf4_method (Optional[str]): method label when the model's base weights are NF4
            (``quantize_base: True`` or a ``qlora_*`` builder), e.g. ``qlora``.
    """

    name: str
    method: str
    mirrors: str
    summary: str
    adds: Tuple[str, ...] = field(default=())
    requires: Tuple[str, ...] = field(default=())
    nf4_method: Optional[str] = None

    def __post_init__(self) -> None:
        # Literal lists in a declaration are fine; store tuples so specs compare and hash.
        object.__setattr__(self, "adds", tuple(self.adds))
        object.__setattr__(self, "requires", tuple(self.requires))

    def method_label(self, model_component: str = "", quantize_base: bool = False) -> str:
        """Method label for a run of this recipe.

        Args:
            model_component (str): the model builder (dotted path or bare name).
            quantize_base (bool): the config's ``model.quantize_base``.

        Returns:
            str: ``nf4_method`` for an NF4 base (when declared), else ``method``.
        """
        builder = model_component.rsplit(".", 1)[-1]
        if self.nf4_method and (quantize_base or builder.startswith("qlora_")):
            return self.nf4_method
        return self.method


_SPEC_FIELDS = frozenset(RecipeSpec.__dataclass_fields__)


class SpecError(ValueError):
    """A recipe file whose ``SPEC`` declaration cannot be read."""


def _literal_spec(call: ast.Call, where: str) -> RecipeSpec:
    if call.args:
        raise SpecError(f"{where}: RecipeSpec(...) takes keyword arguments only")
    kwargs = {}
    for kw in call.keywords:
        if kw.arg not in _SPEC_FIELDS:
            raise SpecError(f"{where}: RecipeSpec has no field {kw.arg!r} (fields: {', '.join(sorted(_SPEC_FIELDS))})")
        try:
            kwargs[kw.arg] = ast.literal_eval(kw.value)
        except ValueError as e:
            raise SpecError(f"{where}: RecipeSpec({kw.arg}=...) must be a literal: {e}") from None
    try:
        return RecipeSpec(**kwargs)
    except TypeError as e:
        raise SpecError(f"{where}: {e}") from None


def _is_spec_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id == "RecipeSpec") or (isinstance(f, ast.Attribute) and f.attr == "RecipeSpec")


def read_spec(path: Path) -> Optional[RecipeSpec]:
    """The spec a recipe file declares, read from its source (nothing is imported).

    The first class with a ``SPEC = RecipeSpec(...)`` assignment wins; otherwise a class
    deriving from a class imported from ``hlmtune.recipes.<name>`` inherits that pack
    recipe's spec.

    Args:
        path (Path): a ``.py`` recipe file.

    Returns:
        Optional[RecipeSpec]: the spec, or None for a file that declares none (not a pack
        recipe, a copy of one, or a subclass of one).

    Raises:
        SpecError: the file does not parse, or its ``SPEC`` is not a literal declaration.
    """
    path = Path(path)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as e:
        raise SpecError(f"{path}: line {e.lineno}: {e.msg}") from None
    pack_classes: Dict[str, str] = {}  # local class name -> pack recipe module stem
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hlmtune.recipes."):
            for alias in node.names:
                pack_classes[alias.asname or alias.name] = node.module.rsplit(".", 1)[-1]
    inherited: Optional[RecipeSpec] = None
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SPEC" for t in stmt.targets):
                if _is_spec_call(stmt.value):
                    return _literal_spec(stmt.value, f"{path}:{stmt.lineno}")
                raise SpecError(f"{path}:{stmt.lineno}: SPEC must be a literal RecipeSpec(...) declaration")
        for base in node.bases:
            if inherited is None and isinstance(base, ast.Name) and base.id in pack_classes:
                inherited = pack_specs().get(pack_classes[base.id])
    return inherited


def pack_recipes_dir() -> Path:
    """Folder holding the pack's recipe files (installed as ``hlmtune.recipes``)."""
    return Path(str(resources.files("hlmtune.recipes")))


def discover_specs(folder: Path) -> Dict[str, RecipeSpec]:
    """Specs of every recipe file in a folder, by name, in file-name order.

    Args:
        folder (Path): a folder of recipe files.

    Returns:
        Dict[str, RecipeSpec]: name -> spec.

    Raises:
        SpecError: a file declares no spec, or its spec's name is not its file stem.
    """
    out: Dict[str, RecipeSpec] = {}
    for p in sorted(Path(folder).glob("*.py")):
        if p.name.startswith("_"):
            continue
        spec = read_spec(p)
        if spec is None:
            raise SpecError(f"{p}: a recipe file must declare SPEC = RecipeSpec(...) in its recipe class")
        if spec.name != p.stem:
            raise SpecError(f"{p}: SPEC name {spec.name!r} must be the file name {p.stem!r}")
        out[spec.name] = spec
    return out


@lru_cache(maxsize=1)
def pack_specs() -> Dict[str, RecipeSpec]:
    """The pack's recipe specs (``recipes/*.py``), read once per process."""
    return discover_specs(pack_recipes_dir())


def method_for(recipe: Optional[str], model: Optional[str]) -> Optional[str]:
    """Method label from a recipe name and model builder name (for runs that do not log one).

    Pack recipes use their spec. torchtune's other recipes (``lora_finetune_single_device``
    ...) take the label of the pack recipe mirroring the same family: the mirrored name
    without its ``_distributed`` suffix is the prefix to match (longest first).
    ``knowledge_distillation_*`` (no pack counterpart) is ``kd``.

    Args:
        recipe (Optional[str]): recipe name.
        model (Optional[str]): model builder name (``qlora_*`` selects the NF4 label).

    Returns:
        Optional[str]: the method, None without a recipe, the recipe name when nothing matches.
    """
    if not recipe:
        return None
    specs = pack_specs()
    r = recipe.lower()
    if r in specs:
        return specs[r].method_label(model or "")
    families = sorted(
        ((s.mirrors.removesuffix("_distributed"), s) for s in specs.values()), key=lambda fs: -len(fs[0])
    )
    for prefix, spec in families:
        if r.startswith(prefix):
            return spec.method_label((model or "").lower())
    if r.startswith("knowledge_distillation"):
        return "kd"
    return recipe
