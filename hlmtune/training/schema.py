"""Config checks: unknown keys and typos are errors naming the closest key.

Each pack recipe accepts every top-level key its same-named torchtune recipe reads or its
shipped configs carry (lists taken from torchtune 0.6.1's recipes and
``recipes/configs``), plus the pack's own keys. Every ``_component_`` node is checked
against the real signature of what it names, so a misspelt builder argument fails at
validation time instead of as a ``TypeError`` deep inside ``instantiate``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Mapping

from omegaconf import DictConfig, OmegaConf

# Keys every torchtune fine-tuning recipe reads.
_TORCHTUNE_COMMON = frozenset(
    {
        "output_dir", "tokenizer", "model", "checkpointer", "resume_from_checkpoint",
        "dataset", "seed", "shuffle", "batch_size", "optimizer", "loss", "epochs",
        "max_steps_per_epoch", "gradient_accumulation_steps", "compile", "metric_logger",
        "log_every_n_steps", "log_peak_memory_stats", "device", "dtype",
        "enable_activation_checkpointing", "enable_activation_offloading",
        "cudnn_deterministic_mode", "custom_sharded_layers", "fsdp_cpu_offload",
        "fsdp_reshard_after_forward", "profiler",
    }
)
_LORA = frozenset({"lr_scheduler", "save_adapter_weights_only", "clip_grad_norm", "collate_fn", "fsdp"})
_FULL = frozenset(
    {"lr_scheduler", "clip_grad_norm", "collate_fn", "optimizer_in_bwd", "ac_mode", "ac_option",
     "enable_async_checkpointing", "tensor_parallel_dim", "tensor_parallel_plan"}
)
_QAT = frozenset({"quantizer", "fake_quant_after_n_steps"})

# The pack's own keys, on every recipe.
PACK_KEYS = frozenset(
    {
        "data_loader",  # {pin_memory, num_workers, split, prefetch_factor, persistent_workers}
        "data_parallel",  # auto | fsdp | ddp
        "save_every_n_steps",  # mid-epoch resumable checkpoints
        "keep_last_n_checkpoints",
        "model_dir",  # the downloaded model directory, referenced as ${model_dir} by other keys
        "data_dir",  # a local data directory, referenced as ${data_dir}
    }
)

RECIPE_KEYS: Dict[str, FrozenSet[str]] = {
    "lora_finetune_distributed": _TORCHTUNE_COMMON | _LORA | PACK_KEYS,
    "full_finetune_distributed": _TORCHTUNE_COMMON | _FULL | PACK_KEYS,
    "lora_dpo_distributed": _TORCHTUNE_COMMON | _LORA | PACK_KEYS,
    "full_dpo_distributed": _TORCHTUNE_COMMON | _FULL | frozenset({"ref_checkpointer"}) | PACK_KEYS,
    "qat_distributed": _TORCHTUNE_COMMON | _FULL | _QAT | frozenset({"quantize"}) | PACK_KEYS,
    "qat_lora_finetune_distributed": _TORCHTUNE_COMMON | _LORA | _QAT | frozenset({"quantize"}) | PACK_KEYS,
}

# Keys a recipe cannot run without.
REQUIRED_KEYS = frozenset(
    {"output_dir", "tokenizer", "model", "dataset", "seed", "shuffle", "batch_size", "optimizer",
     "loss", "epochs", "metric_logger", "device", "dtype"}
)

DATA_LOADER_KEYS = frozenset({"pin_memory", "num_workers", "split", "prefetch_factor", "persistent_workers"})
QUANTIZE_KEYS = frozenset({"enabled", "quantizer", "model", "output_name"})
SPLIT_CHOICES = ("distributed", "contiguous")
DATA_PARALLEL_CHOICES = ("auto", "fsdp", "ddp")

# Arguments the recipe passes itself, per config section (so configs must not give them).
_RECIPE_SUPPLIED = {
    "optimizer": {"params"},
    "lr_scheduler": {"optimizer", "num_training_steps", "last_epoch"},
    "dataset": {"tokenizer", "model_transform"},
    "checkpointer": set(),
}


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem with its key path."""


def _closest(name: str, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def resolve_component(path: str) -> Callable[..., Any]:
    """Import the object a ``_component_`` dotpath names.

    Args:
        path (str): e.g. ``torchtune.models.llama3.lora_llama3_8b``.

    Returns:
        Callable[..., Any]: the function or class.

    Raises:
        ConfigError: the module or attribute does not exist.
    """
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod_name, attrs = ".".join(parts[:i]), parts[i:]
        try:
            obj: Any = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and not mod_name.startswith(e.name) and not e.name.startswith(mod_name):
                raise ConfigError(f"'{path}': importing {mod_name} failed: {e}") from e
            continue
        try:
            for a in attrs:
                obj = getattr(obj, a)
        except AttributeError:
            public = [n for n in dir(importlib.import_module(mod_name)) if not n.startswith("_")]
            raise ConfigError(f"'{path}': {mod_name} has no '{'.'.join(attrs)}'{_closest(attrs[0], public)}")
        return obj
    raise ConfigError(f"'{path}' cannot be imported")


def _check_component(node: Mapping[str, Any], where: str, errors: List[str]) -> None:
    comp = node.get("_component_")
    if not isinstance(comp, str):
        errors.append(f"{where}._component_ must be a dotted path string, got {comp!r}")
        return
    try:
        target = resolve_component(comp)
    except ConfigError as e:
        errors.append(f"{where}._component_: {e}")
        return
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # builtins without signatures: nothing to check
        return
    params = sig.parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    given = [k for k in node.keys() if k != "_component_"]
    named = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    for k in given:
        if k in params:
            continue
        if not has_var_kw:
            errors.append(f"{where}.{k}: {comp} has no argument '{k}'{_closest(k, named)}")
        elif difflib.get_close_matches(k, named, n=1, cutoff=0.8):
            # **kwargs would swallow it (e.g. load_dataset kwargs), but it is one edit away
            # from a declared argument: almost certainly a typo.
            errors.append(f"{where}.{k}: {comp} has no argument '{k}'{_closest(k, named)}")
    supplied = _RECIPE_SUPPLIED.get(where.split(".")[0], set()) if "." not in where else set()
    positional_slots = 1 if where in ("dataset", "optimizer", "lr_scheduler") else 0
    missing = []
    for i, (name, p) in enumerate(params.items()):
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.default is not p.empty:
            continue
        if name in given or name in supplied or name == "self":
            continue
        if i < positional_slots:
            continue
        missing.append(name)
    if missing:
        errors.append(f"{where}: {comp} needs {', '.join(repr(m) for m in missing)}")
    # Nested components (e.g. a wrapped metric logger) are checked too.
    for k in given:
        v = node[k]
        if isinstance(v, Mapping) and "_component_" in v:
            _check_component(v, f"{where}.{k}", errors)


def validate_config(cfg: DictConfig | Mapping[str, Any], recipe: str, *, check_components: bool = True) -> None:
    """Check a resolved config against a recipe.

    Args:
        cfg (DictConfig | Mapping[str, Any]): the config, overrides applied.
        recipe (str): a pack recipe name (a key of ``RECIPE_KEYS``).
        check_components (bool): also import every ``_component_`` and check its arguments.

    Raises:
        ConfigError: listing every unknown key (with the closest known one), missing
            required key, bad value and bad component argument.
    """
    if recipe not in RECIPE_KEYS:
        raise ConfigError(f"unknown recipe '{recipe}'{_closest(recipe, RECIPE_KEYS)}; known: {', '.join(sorted(RECIPE_KEYS))}")
    if isinstance(cfg, DictConfig):
        data = OmegaConf.to_container(cfg, resolve=True)
    else:
        data = dict(cfg)
    allowed = RECIPE_KEYS[recipe]
    errors: List[str] = []
    for key in data:
        if key not in allowed:
            errors.append(f"unknown key '{key}' for recipe {recipe}{_closest(key, allowed)}")
    for key in sorted(REQUIRED_KEYS - set(data)):
        errors.append(f"missing required key '{key}'")
    _check_values(data, recipe, errors)
    if check_components:
        for key, value in data.items():
            if key not in allowed:
                continue
            if isinstance(value, Mapping) and "_component_" in value:
                _check_component(value, key, errors)
            elif isinstance(value, list):  # e.g. a list of datasets (ConcatDataset)
                for i, item in enumerate(value):
                    if isinstance(item, Mapping) and "_component_" in item:
                        _check_component(item, f"{key}[{i}]", errors)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _check_values(data: Mapping[str, Any], recipe: str, errors: List[str]) -> None:
    def positive_int(key: str, allow_none: bool = False) -> None:
        if key not in data:
            return
        v = data[key]
        if v is None and allow_none:
            return
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            errors.append(f"{key} must be a positive integer, got {v!r}")

    for key in ("batch_size", "epochs", "gradient_accumulation_steps"):
        positive_int(key)
    for key in ("max_steps_per_epoch", "save_every_n_steps", "log_every_n_steps", "keep_last_n_checkpoints"):
        positive_int(key, allow_none=True)
    if "dtype" in data and data["dtype"] not in ("fp32", "bf16"):
        errors.append(f"dtype must be 'fp32' or 'bf16', got {data['dtype']!r}")
    if "device" in data and data["device"] is not None:
        dev = str(data["device"])
        if dev.split(":")[0] not in ("cpu", "cuda"):
            errors.append(f"device must be 'cpu' or 'cuda', got {dev!r}")
    dp = data.get("data_parallel", "auto")
    if dp not in DATA_PARALLEL_CHOICES:
        errors.append(f"data_parallel must be one of {DATA_PARALLEL_CHOICES}, got {dp!r}{_closest(str(dp), DATA_PARALLEL_CHOICES)}")
    dl = _pack_section(data, "data_loader", DATA_LOADER_KEYS, errors)
    if dl:
        if dl.get("split", "distributed") not in SPLIT_CHOICES:
            errors.append(f"data_loader.split must be one of {SPLIT_CHOICES}, got {dl.get('split')!r}")
        nw = dl.get("num_workers", 0)
        if not isinstance(nw, int) or nw < 0:
            errors.append(f"data_loader.num_workers must be an integer >= 0, got {nw!r}")
    _pack_section(data, "quantize", QUANTIZE_KEYS, errors)
    if data.get("optimizer_in_bwd"):
        errors.append("optimizer_in_bwd=True is not supported by the pack recipes (use a paged 8-bit optimizer to save memory)")
    tp = data.get("tensor_parallel_dim", 1)
    if tp not in (None, 1):
        errors.append(f"tensor_parallel_dim={tp!r}: the pack recipes are data parallel only (use 1)")
    if recipe.startswith("qat") and "quantizer" not in data:
        errors.append("missing required key 'quantizer' (QAT recipes need a QAT quantizer)")
    if recipe.endswith("dpo_distributed") and "checkpointer" not in data:
        errors.append("missing required key 'checkpointer' (DPO starts from a trained model)")
    if recipe != "full_finetune_distributed" and "checkpointer" not in data:
        errors.append("missing required key 'checkpointer'")


def _pack_section(data: Mapping[str, Any], name: str, allowed: FrozenSet[str], errors: List[str]) -> Mapping[str, Any]:
    """Check a pack section (a plain mapping of known keys); returns it, or {} when absent or bad."""
    section = data.get(name)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        errors.append(f"{name} must be a mapping, got {section!r}")
        return {}
    for k in section:
        if k not in allowed:
            errors.append(f"unknown key '{name}.{k}'{_closest(k, allowed)}")
    return section


def build_model_on_meta(cfg_model: DictConfig, dtype: str = "bf16") -> int:
    """Instantiate the config's model on the meta device (no memory, no weights).

    Args:
        cfg_model (DictConfig): the ``model`` section.
        dtype (str): ``bf16`` or ``fp32``.

    Returns:
        int: number of parameters.
    """
    import torch
    from torchtune import config as tt_config
    from torchtune import training

    with training.set_default_dtype(training.get_dtype(dtype, device=torch.device("cpu"))), torch.device("meta"):
        model = tt_config.instantiate(cfg_model)
    return sum(p.numel() for p in model.parameters())
