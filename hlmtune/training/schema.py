"""Config checks: unknown keys and typos are errors naming the closest key.

Each pack recipe declares (``hlmtune.training.spec.RecipeSpec``) the torchtune recipe it
mirrors and the keys it adds; it accepts every top-level key that torchtune recipe reads or
its shipped configs carry (lists taken from torchtune 0.6.1's recipes and
``recipes/configs``), plus the pack's own keys (``hlmtune.training.options``). Every
``_component_`` node is checked against the real signature of what it names, so a misspelt
builder argument fails at validation time instead of as a ``TypeError`` deep inside
``instantiate``.

Not everything accepted is an error or honoured: :func:`config_warnings` lists, one line
per key, the keys that are accepted but do nothing here (a key another torchtune recipe
reads, e.g. ``save_adapter_weights_only`` in a full-weight config copied from a LoRA one; a
torchtune key the pack does not implement, e.g. ``enable_async_checkpointing: True``), so a
config torchtune's recipe runs also runs here, and says what it ignores.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Union

from omegaconf import DictConfig, OmegaConf

from hlmtune.training.options import PACK_KEY_DOCS, PackOptions, closest, effective_compile_mode, parse_pack_options
from hlmtune.training.spec import RecipeSpec, pack_specs

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

# The top-level keys of the torchtune 0.6.1 recipes a pack recipe may mirror (RecipeSpec.mirrors).
TORCHTUNE_RECIPE_KEYS: Dict[str, FrozenSet[str]] = {
    "lora_finetune_distributed": _TORCHTUNE_COMMON | _LORA,
    "full_finetune_distributed": _TORCHTUNE_COMMON | _FULL,
    "lora_dpo_distributed": _TORCHTUNE_COMMON | _LORA,
    "full_dpo_distributed": _TORCHTUNE_COMMON | _FULL | frozenset({"ref_checkpointer"}),
    "qat_distributed": _TORCHTUNE_COMMON | _FULL | _QAT,
    "qat_lora_finetune_distributed": _TORCHTUNE_COMMON | _LORA | _QAT,
}
# Keys only torchtune's other recipes read (single-device, knowledge distillation).
_OTHER_TORCHTUNE = frozenset({"low_cpu_ram", "teacher_model", "teacher_checkpointer", "kd_loss", "kd_ratio"})
ANY_TORCHTUNE_KEYS: FrozenSet[str] = frozenset().union(*TORCHTUNE_RECIPE_KEYS.values()) | _OTHER_TORCHTUNE

# The pack's own keys, on every recipe: the typed options (hlmtune.training.options) and
# two folder variables the shipped configs reference as ${model_dir} / ${data_dir}. Any
# other top-level key that the config references by interpolation (e.g. ${shards_dir}) is a
# config variable too and is accepted.
PACK_KEYS = frozenset(PACK_KEY_DOCS) | frozenset({"model_dir", "data_dir"})

# Keys a mirrored torchtune recipe reads that the pack accepts but does not implement:
# key -> (value that is honoured anyway, why it is ignored otherwise).
NOT_HONOURED: Dict[str, tuple] = {
    "enable_async_checkpointing": (lambda v: not v, "checkpoints are written synchronously"),
    "tensor_parallel_plan": (lambda v: v is None, "the pack recipes are data parallel only"),
    "fsdp": (lambda v: False, "set fsdp_cpu_offload / fsdp_reshard_after_forward instead"),
}

# Keys a recipe cannot run without (a spec's `requires` adds to them).
REQUIRED_KEYS = frozenset(
    {"output_dir", "tokenizer", "model", "dataset", "seed", "shuffle", "batch_size", "optimizer",
     "loss", "epochs", "metric_logger", "device", "dtype"}
)

# Arguments the recipe passes itself, per config section (so configs must not give them).
_RECIPE_SUPPLIED = {
    "optimizer": {"params"},
    "lr_scheduler": {"optimizer", "num_training_steps", "last_epoch"},
    "dataset": {"tokenizer", "model_transform"},
    "checkpointer": set(),
}


# What a `profiler:` section without `_component_` is built as (torchtune's recipes do the same).
PROFILER_COMPONENT = "torchtune.training.setup_torch_profiler"

def accepted_keys(spec: RecipeSpec) -> FrozenSet[str]:
    """Top-level keys a recipe accepts: its mirrored torchtune recipe's, its own, the pack's.

    Raises:
        ConfigError: the spec mirrors a recipe missing from ``TORCHTUNE_RECIPE_KEYS``.
    """
    if spec.mirrors not in TORCHTUNE_RECIPE_KEYS:
        raise ConfigError(
            f"recipe {spec.name} mirrors '{spec.mirrors}'{closest(spec.mirrors, TORCHTUNE_RECIPE_KEYS)}; "
            f"known: {', '.join(sorted(TORCHTUNE_RECIPE_KEYS))}"
        )
    return TORCHTUNE_RECIPE_KEYS[spec.mirrors] | frozenset(spec.adds) | frozenset(spec.requires) | PACK_KEYS


def recipe_spec(recipe: Union[str, RecipeSpec]) -> RecipeSpec:
    """The spec of a pack recipe name (a spec passes through).

    Raises:
        ConfigError: not a pack recipe (names the closest).
    """
    if isinstance(recipe, RecipeSpec):
        return recipe
    specs = pack_specs()
    if recipe not in specs:
        raise ConfigError(f"unknown recipe '{recipe}'{closest(recipe, specs)}; known: {', '.join(sorted(specs))}")
    return specs[recipe]


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem with its key path.

    Attributes:
        problems (List[str]): one line per problem (the message without its header).
    """

    def __init__(self, message: str, problems: List[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems is not None else [message]


# Accepted keys per pack recipe, derived from the specs.
RECIPE_KEYS: Dict[str, FrozenSet[str]] = {name: accepted_keys(s) for name, s in pack_specs().items()}

_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


def config_variables(cfg: Any) -> FrozenSet[str]:
    """Top-level keys that other values reference as ``${key}`` (folder variables and the like).

    Args:
        cfg (Any): an unresolved ``DictConfig`` (a plain mapping has no interpolations left).

    Returns:
        FrozenSet[str]: referenced top-level key names present in the config.
    """
    if not isinstance(cfg, DictConfig):
        return frozenset()
    found: set = set()

    def walk(node: Any) -> None:
        if isinstance(node, str):
            found.update(_INTERPOLATION.findall(node))
        elif isinstance(node, Mapping):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(OmegaConf.to_container(cfg, resolve=False))
    return frozenset(k for k in found if k in cfg)


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
            raise ConfigError(f"'{path}': {mod_name} has no '{'.'.join(attrs)}'{closest(attrs[0], public)}")
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
            errors.append(f"{where}.{k}: {comp} has no argument '{k}'{closest(k, named)}")
        elif difflib.get_close_matches(k, named, n=1, cutoff=0.8):
            # **kwargs would swallow it (e.g. load_dataset kwargs), but it is one edit away
            # from a declared argument: almost certainly a typo.
            errors.append(f"{where}.{k}: {comp} has no argument '{k}'{closest(k, named)}")
    # A builder may check its arguments' values without reading any file (``check_arguments``: the
    # beat builders' option ranges), so `hlmtune validate` refuses them before data exists.
    # Unknown keys are named above (with the closest one), so only the builder's own keys go in.
    check = getattr(target, "check_arguments", None)
    if callable(check):
        own = {k: node[k] for k in given if k in params}
        try:
            check(own)
        except ValueError as e:
            errors.append(f"{where}: {e}")
        except TypeError as e:  # a value of the wrong type (int(None), ...): name the keys set to null
            nulls = [k for k, v in own.items() if v is None and params[k].default is not None]  # not null by default
            errors.append(f"{where}: {e}" + (f" (null: {', '.join(nulls)})" if nulls else ""))
    # A top-level section, or an item of a list section (dataset[i] of a ConcatDataset), gets the
    # arguments the recipe passes; nested components do not.
    section = where.split("[")[0] if "." not in where else None
    supplied = _RECIPE_SUPPLIED.get(section, set())
    positional_slots = 1 if section in ("dataset", "optimizer", "lr_scheduler") else 0
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


def _plain(cfg: DictConfig | Mapping[str, Any]) -> Dict[str, Any]:
    if isinstance(cfg, DictConfig):
        try:
            return OmegaConf.to_container(cfg, resolve=True)
        except Exception as e:  # omegaconf's InterpolationResolutionError and kin
            raise ConfigError(f"cannot resolve the config: {str(e).splitlines()[0]}") from None
    return dict(cfg)


def validate_config(
    cfg: DictConfig | Mapping[str, Any], recipe: Union[str, RecipeSpec], *, check_components: bool = True
) -> PackOptions:
    """Check a resolved config against a recipe.

    Args:
        cfg (DictConfig | Mapping[str, Any]): the config, overrides applied.
        recipe (Union[str, RecipeSpec]): a pack recipe name, or the spec of a recipe file.
        check_components (bool): also import every ``_component_`` and check its arguments.

    Returns:
        PackOptions: the pack's own keys, parsed (what the recipe uses).

    Raises:
        ConfigError: listing every unknown key (with the closest known one), missing
            required key, bad value and bad component argument.
    """
    spec = recipe_spec(recipe)
    data = _plain(cfg)
    allowed = accepted_keys(spec)
    variables = config_variables(cfg)
    errors: List[str] = []
    for key in data:
        if key not in allowed and key not in ANY_TORCHTUNE_KEYS and key not in variables:
            errors.append(f"unknown key '{key}' for recipe {spec.name}{closest(key, allowed)}")
    for key in sorted(REQUIRED_KEYS - set(data)):
        errors.append(f"missing required key '{key}'")
    for key in spec.requires:
        if data.get(key) is None:
            errors.append(f"missing required key '{key}' ({spec.name} cannot run without it)")
    options = _check_values(data, allowed, errors)
    if check_components:
        for key, value in data.items():
            if key not in allowed:
                continue
            if key == "profiler" and isinstance(value, Mapping) and "_component_" not in value:
                # the recipes build a profiler section without a component as torchtune's default
                value = {"_component_": PROFILER_COMPONENT, **value}
            if isinstance(value, Mapping) and "_component_" in value:
                _check_component(value, key, errors)
            elif isinstance(value, list):  # e.g. a list of datasets (ConcatDataset)
                for i, item in enumerate(value):
                    if isinstance(item, Mapping) and "_component_" in item:
                        _check_component(item, f"{key}[{i}]", errors)
        _check_pairing(spec, data, errors)
        _check_lengths(data, errors)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors), errors)
    return options


def _signature(comp: Any) -> Any:
    """``inspect.Signature`` of what a ``_component_`` path names, or None (unresolvable, no signature)."""
    try:
        return inspect.signature(resolve_component(comp))
    except (ConfigError, TypeError, ValueError):
        return None


def dataset_nodes(data: Mapping[str, Any]) -> List[tuple]:
    """(key path, node) of the config's dataset section: ``dataset``, or ``dataset[i]`` per item of a
    list (ConcatDataset), as :func:`_check_component` names them."""
    sets = data.get("dataset")
    return [(f"dataset[{i}]", d) for i, d in enumerate(sets)] if isinstance(sets, list) else [("dataset", sets)]


def _model_context(model: Mapping[str, Any]) -> Any:
    """The model's longest sequence: its ``max_seq_len`` key, else its builder's default, else None."""
    if model.get("max_seq_len") is not None:
        return model["max_seq_len"]
    sig = _signature(model["_component_"])
    p = sig.parameters.get("max_seq_len") if sig is not None else None
    return None if p is None or p.default is p.empty else p.default


def _check_lengths(data: Mapping[str, Any], errors: List[str]) -> None:
    """Sequences longer than the model's context (its RoPE cache) fail at step 1 in torchtune's
    attention; name the two keys here instead. Only lengths the config states are compared."""
    model = data.get("model")
    if not (isinstance(model, Mapping) and isinstance(model.get("_component_"), str)):
        return
    ctx = _model_context(model)
    if not isinstance(ctx, int):
        return
    for where, node in [("tokenizer", data.get("tokenizer")), *dataset_nodes(data)]:
        n = node.get("max_seq_len") if isinstance(node, Mapping) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > ctx:
            errors.append(f"{where}.max_seq_len: {n} is longer than the model's context (model.max_seq_len = {ctx}"
                          f"{'' if model.get('max_seq_len') is not None else ', the default of ' + model['_component_']})"
                          f": lower it, or raise model.max_seq_len")


def _builder_kind(comp: Any) -> tuple:
    """(is a LoRA model builder, what a dataset builder returns) of a ``_component_`` path.

    Read from the signature: torchtune's and the pack's LoRA builders take
    ``lora_attn_modules``; a dataset builder's return annotation names its class
    (``PreferenceDataset``, ``ValidatedPreferenceDataset``, ``SFTDataset`` ...). Unknown or
    unannotated components give (None, ""): nothing is concluded from them.
    """
    sig = _signature(comp)
    if sig is None:
        return None, ""
    ret = sig.return_annotation
    ret = "" if ret is inspect.Signature.empty else (ret if isinstance(ret, str) else str(ret))
    return "lora_attn_modules" in sig.parameters, ret


def _check_pairing(spec: RecipeSpec, data: Mapping[str, Any], errors: List[str]) -> None:
    """A recipe paired with the wrong kind of model or data fails here, not at step 1.

    The kind comes from the torchtune recipe the spec mirrors: ``*lora*`` recipes train only
    adapters (a model without them has nothing to train; a LoRA model under a full-weight
    recipe cannot load a base checkpoint, whose keys lack the adapters), and ``*dpo*`` recipes
    read preference pairs (an SFT dataset has no chosen/rejected columns, and the reverse).
    """
    adapters = "lora" in spec.mirrors
    preference = "dpo" in spec.mirrors
    model = data.get("model")
    if isinstance(model, Mapping) and isinstance(model.get("_component_"), str):
        is_lora, _ = _builder_kind(model["_component_"])
        comp = model["_component_"]
        if is_lora is False and adapters:
            errors.append(f"model._component_: {comp} builds no LoRA adapters, and {spec.name} trains only adapters "
                          f"(use a lora_* / qlora_* builder, or a full-weight recipe)")
        elif is_lora and not adapters:
            errors.append(f"model._component_: {comp} is a LoRA builder, and {spec.name} trains every weight from a "
                          f"checkpoint without adapter keys (use the base builder, or a LoRA recipe)")
    for where, ds in dataset_nodes(data):
        if not (isinstance(ds, Mapping) and isinstance(ds.get("_component_"), str)):
            continue
        _, ret = _builder_kind(ds["_component_"])
        if not ret:
            continue
        is_pref = "Preference" in ret
        if preference and not is_pref:
            errors.append(f"{where}._component_: {ds['_component_']} returns {ret}, and {spec.name} needs preference "
                          "pairs (chosen / rejected): use a preference builder, e.g. "
                          "hlmtune.data_builders.hh_rlhf_dataset or ecg_beat_dpo_dataset")
        elif is_pref and not preference:
            errors.append(f"{where}._component_: {ds['_component_']} returns preference pairs ({ret}), which "
                          f"{spec.name} does not read: use a DPO recipe (lora_dpo_distributed, full_dpo_distributed)")


def config_warnings(cfg: DictConfig | Mapping[str, Any], recipe: Union[str, RecipeSpec]) -> List[str]:
    """One line per key the recipe accepts but does not honour (``validate``/``run`` print them).

    Args:
        cfg (DictConfig | Mapping[str, Any]): the config, overrides applied.
        recipe (Union[str, RecipeSpec]): a pack recipe name, or the spec of a recipe file.

    Returns:
        List[str]: warnings, naming the key, its value and why it has no effect.
    """
    spec = recipe_spec(recipe)
    data = _plain(cfg)
    allowed = accepted_keys(spec)
    owners = {k: sorted(r for r, keys in TORCHTUNE_RECIPE_KEYS.items() if k in keys) for k in ANY_TORCHTUNE_KEYS}
    out: List[str] = []
    for key, value in data.items():
        if key not in allowed and key in ANY_TORCHTUNE_KEYS:
            read_by = ", ".join(owners[key]) or "torchtune's single-device / distillation recipes"
            out.append(f"key '{key}' ({value!r}) is ignored: {read_by} read it, {spec.name} does not")
        elif key in NOT_HONOURED and key in allowed:
            honoured, why = NOT_HONOURED[key]
            if not honoured(value):
                out.append(f"key '{key}' ({value!r}) is ignored by {spec.name}: {why}")
    ck = data.get("checkpointer")
    if isinstance(ck, Mapping):
        # The pack's recipes resume from their own checkpoints (training/checkpoint.py) and hand
        # the torchtune checkpointer resume_from_checkpoint=False: these keys change nothing there.
        if ck.get("resume_from_checkpoint"):
            out.append("key 'checkpointer.resume_from_checkpoint' (True) is ignored: the pack's recipes resume "
                       "from their own checkpoints; set the top-level resume_from_checkpoint=True")
        if ck.get("recipe_checkpoint") is not None:
            out.append(f"key 'checkpointer.recipe_checkpoint' ({ck['recipe_checkpoint']!r}) is ignored: the pack's "
                       "recipes keep their state in output_dir/checkpoints (resume_from_checkpoint=True)")
    mode = data.get("compile_mode", "default")
    if mode != "default" and not data.get("compile", False):
        out.append(f"key 'compile_mode' ({mode!r}) is ignored: compile is not True")
    elif mode != "default" and str(data.get("device") or "cpu").split(":")[0] != "cuda":
        _, why = effective_compile_mode(mode, "cpu", "none")
        if why:
            out.append(f"key {why}")
    if data.get("ac_auto_budget_gib") is not None and data.get("enable_activation_checkpointing") != "auto":
        out.append(f"key 'ac_auto_budget_gib' ({data['ac_auto_budget_gib']!r}) is ignored: "
                   "enable_activation_checkpointing is not 'auto'")
    if "ac_mode" in allowed and data.get("ac_mode") is not None and data.get("enable_activation_checkpointing") is True:
        out.append(
            f"keys 'ac_mode' ({data['ac_mode']!r}) and 'enable_activation_checkpointing' (True) are both set: "
            "as in torchtune 0.6.1, no activation checkpointing is applied (set one of them)"
        )
    return out


def _check_values(data: Mapping[str, Any], allowed: FrozenSet[str], errors: List[str]) -> PackOptions:
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
    for key in ("max_steps_per_epoch", "log_every_n_steps"):
        positive_int(key, allow_none=True)
    if "dtype" in data and data["dtype"] not in ("fp32", "bf16"):
        errors.append(f"dtype must be 'fp32' or 'bf16', got {data['dtype']!r}")
    if "device" in data and data["device"] is not None:
        dev = str(data["device"])
        if dev.split(":")[0] not in ("cpu", "cuda"):
            errors.append(f"device must be 'cpu' or 'cuda', got {dev!r}")
    if "optimizer_in_bwd" in allowed and data.get("optimizer_in_bwd"):
        errors.append("optimizer_in_bwd=True is not supported by the pack recipes (use a paged 8-bit optimizer to save memory)")
    tp = data.get("tensor_parallel_dim", 1) if "tensor_parallel_dim" in allowed else 1
    if tp not in (None, 1):
        errors.append(f"tensor_parallel_dim={tp!r}: the pack recipes are data parallel only (use 1)")
    return parse_pack_options(data, allowed, errors, closest)


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
