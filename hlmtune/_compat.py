"""The one place that touches torchtune internals (private modules, underscore names).

torchtune 0.6.1 is frozen upstream; torchao moves on. Everything here is either a private
torchtune name we depend on, or a shim for a torchao API change, so a version bump is a
one-file review. Public torchtune APIs (``torchtune.training``, ``torchtune.modules`` ...)
are imported directly where used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

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
