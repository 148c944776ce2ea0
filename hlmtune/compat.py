"""The one place that touches torchtune internals (private modules, underscore names).

torchtune 0.6.1 is frozen upstream; torchao moves on. Everything here is either a private
torchtune name we depend on, or a shim for a torchao API change, so a version bump is a
one-file review. Public torchtune APIs (``torchtune.training``, ``torchtune.modules`` ...)
are imported directly where used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, Dict

if TYPE_CHECKING:  # pragma: no cover
    from omegaconf import DictConfig


def llama3_special_tokens() -> Dict[str, int]:
    """Llama3's 256 special tokens and their ids (``torchtune.models.llama3._tokenizer``)."""
    from torchtune.models.llama3._tokenizer import LLAMA3_SPECIAL_TOKENS

    return dict(LLAMA3_SPECIAL_TOKENS)


def fake_quant_toggles(quantizer_mode: str):
    """(disable, enable) callables for ``model.apply`` that switch QAT fake quantization.

    torchtune keeps them private (``training.quantization._get_{disable,enable}_fake_quant``).
    """
    from torchtune.training.quantization import _get_disable_fake_quant, _get_enable_fake_quant

    return _get_disable_fake_quant(quantizer_mode), _get_enable_fake_quant(quantizer_mode)


def ensure_torchao_aliases() -> None:
    """Keep torchtune 0.6.1's QAT-LoRA import working on torchao 0.13/0.14.

    Those releases renamed ``FakeQuantizeConfig`` to ``IntxFakeQuantizeConfig``; torchtune
    still imports the old name. No-op on the pinned torchao (<0.12) where the name exists.
    """
    try:
        from torchao.quantization import qat
    except ImportError:  # pragma: no cover - torchao missing: QAT recipes report it on use
        return
    if not hasattr(qat, "FakeQuantizeConfig") and hasattr(qat, "IntxFakeQuantizeConfig"):
        qat.FakeQuantizeConfig = qat.IntxFakeQuantizeConfig


# What ``import torchtune`` takes from Hugging Face ``datasets`` at import time (torchtune 0.6.1:
# ``data/_utils.py`` and ``datasets/_{sft,preference,text_completion}.py``), by module.
_TORCHTUNE_HF_NAMES = {"datasets": ("load_dataset",), "datasets.distributed": ("split_dataset_by_node",)}


def _forwarder(module: str, name: str) -> Callable[..., Any]:
    """A function that imports ``module`` on its first call and calls ``module.name``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{module}.{name}``, imported on first call (hlmtune defers Hugging Face datasets)."
    return call


def import_torchtune_deferring_hf_datasets() -> bool:
    """Import torchtune without importing Hugging Face ``datasets`` (and pyarrow, pandas).

    ``import torchtune`` imports ``datasets`` for two names it calls only when a dataset is
    built from the Hub or a file (``load_dataset``, ``split_dataset_by_node``); that pulls in
    pyarrow and pandas, ~100 MiB of resident memory per rank that a run on token shards (the
    ECG model, pre-tokenized rows) never uses. During torchtune's import only, stand-in modules
    give it forwarders that import the real ``datasets`` on their first call; the stand-ins are
    then removed, so any later ``import datasets`` is the real package.

    Returns:
        bool: True if torchtune was imported here with the deferral; False if torchtune or
        datasets was already imported, or datasets is not installed (nothing to defer).
    """
    if "torchtune" in sys.modules or "datasets" in sys.modules or importlib.util.find_spec("datasets") is None:
        return False
    standins = {}
    for module, names in _TORCHTUNE_HF_NAMES.items():
        stub = types.ModuleType(module)
        for name in names:
            setattr(stub, name, _forwarder(module, name))
        standins[module] = stub
    standins["datasets"].distributed = standins["datasets.distributed"]
    sys.modules.update(standins)
    try:
        importlib.import_module("torchtune")
    finally:
        for module, stub in standins.items():
            if sys.modules.get(module) is stub:
                del sys.modules[module]
    return True


def load_config(config_path: str, overrides: list) -> "DictConfig":
    """Load a YAML config and apply ``key=value`` / ``~key`` overrides exactly as ``tune run`` does.

    Uses torchtune's private ``config._utils._merge_yaml_and_cli_args`` so that
    ``hlmtune validate`` / ``hlmtune run`` see the same config the recipe will.

    Args:
        config_path (str): YAML file.
        overrides (list): CLI overrides.

    Returns:
        DictConfig: merged config (interpolations unresolved).
    """
    from argparse import Namespace

    from omegaconf import OmegaConf
    from torchtune.config._utils import _merge_yaml_and_cli_args

    import yaml

    try:
        base = OmegaConf.load(config_path)
    except yaml.YAMLError as e:
        raise ValueError(yaml_error_line(config_path, e)) from None
    if "config" in base:
        raise ValueError(f"{config_path}: 'config' cannot be a key of a config file")
    return _merge_yaml_and_cli_args(Namespace(**OmegaConf.to_container(base, resolve=False)), list(overrides))


def yaml_error_line(path: str, err: Exception) -> str:
    """One line for a YAML syntax error (PyYAML's own message spans several lines).

    Args:
        path (str): the file.
        err (Exception): the ``yaml.YAMLError``.

    Returns:
        str: ``<path>: YAML syntax error at line L, column C: <problem>; fix the file``.
    """
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark, ctx = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
    where = f" at {at(mark)}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    if context and ctx is not None:
        problem += f" ({context} at {at(ctx)})"
    return f"{path}: YAML syntax error{where}: {problem}; fix the file"


def builtin_recipes():
    """torchtune's recipe registry (``torchtune._recipe_registry``) and its root folder."""
    from pathlib import Path

    import torchtune
    from torchtune._recipe_registry import get_all_recipes

    return get_all_recipes(), Path(torchtune.__file__).parent.parent / "recipes"
