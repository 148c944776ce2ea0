"""The pack's own config keys as typed dataclasses: one owner for names, defaults and checks.

torchtune's recipes read their keys ad hoc (``cfg.get("x", default)`` wherever needed);
the pack's own keys (``data_loader``, ``data_parallel``, ``save_every_n_steps``,
``keep_last_n_checkpoints``, ``quantize``) and the torchtune keys whose semantics the
pack implements itself (``ac_mode``/``ac_option``, ``log_peak_memory_stats``) are parsed
here once, after torchtitan's ``JobConfig``: validation (``hlmtune validate``, ``hlmtune
run`` before launch) and the recipe read the same :class:`PackOptions`, so a name, a
default or an allowed value lives in exactly one place.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple

SPLIT_CHOICES = ("distributed", "contiguous")
DATA_PARALLEL_CHOICES = ("auto", "fsdp", "ddp")
AC_MODES = ("none", "full", "selective")
# torch.compile modes; the two that capture CUDA graphs need CUDA and unsharded parameters.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_WITHOUT_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def effective_compile_mode(mode: str, device_type: str, data_parallel: str) -> Tuple[str, Optional[str]]:
    """The compile mode a run can use, and why it differs from the one asked for (or None).

    CUDA graphs (``reduce-overhead``, ``max-autotune``) replay kernels at fixed addresses: they
    need CUDA, and FSDP2's per-step all-gather re-allocates the unsharded parameters a graph
    would have captured, so FSDP runs (and CPU runs) compile without graphs instead.

    Args:
        mode (str): one of ``COMPILE_MODES``.
        device_type (str): ``cuda`` or ``cpu``.
        data_parallel (str): the resolved wrapper: ``fsdp``, ``ddp`` or ``none``.

    Returns:
        Tuple[str, Optional[str]]: (mode to compile with, reason it was changed).
    """
    if mode not in _WITHOUT_GRAPHS:
        return mode, None
    if device_type != "cuda":
        return _WITHOUT_GRAPHS[mode], f"compile_mode '{mode}' captures CUDA graphs, none on {device_type}: compiling with '{_WITHOUT_GRAPHS[mode]}'"
    if data_parallel == "fsdp":
        return _WITHOUT_GRAPHS[mode], (f"compile_mode '{mode}': CUDA graphs cannot hold FSDP2's re-gathered parameters: "
                                       f"compiling with '{_WITHOUT_GRAPHS[mode]}' (use data_parallel: ddp for graphs)")
    return mode, None


def closest(name: Any, choices: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'X'?)`` for the choice closest to ``name``, written as ``prefix + X`` (the
    full key of a section's field, e.g. ``data_loader.num_workers``), or ``""``: the one hint of
    every unknown-key and unknown-value error (configs, grid files, selection plans)."""
    match = difflib.get_close_matches(str(name), sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{match[0]}'?)" if match else ""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Checks: each returns None when a value is acceptable, else what it must be ("must be ...").
def check_bool(v: Any) -> Optional[str]:
    return None if isinstance(v, bool) else "must be True or False"


def check_opt_bool(v: Any) -> Optional[str]:
    return None if v is None or isinstance(v, bool) else "must be True, False or null"


def check_int_ge0(v: Any) -> Optional[str]:
    return None if _is_int(v) and v >= 0 else "must be an integer >= 0"


def check_int_gt0(v: Any) -> Optional[str]:
    return None if _is_int(v) and v > 0 else "must be an integer > 0"


def check_opt_int_gt0(v: Any) -> Optional[str]:
    return None if v is None or (_is_int(v) and v > 0) else "must be a positive integer or null"


def check_choice(choices: Tuple[str, ...]) -> Callable[[Any], Optional[str]]:
    """A check that accepts one of ``choices`` (kept on the check for the did-you-mean hint)."""
    def check(v: Any) -> Optional[str]:
        return None if v in choices else f"must be one of {choices}"

    check.choices = choices  # type: ignore[attr-defined]  # for the did-you-mean hint
    return check


def check_opt_str(v: Any) -> Optional[str]:
    return None if v is None or isinstance(v, str) else "must be a string or null"


def check_str(v: Any) -> Optional[str]:
    return None if isinstance(v, str) and v.strip() else "must be a non-empty string"


def check_str_list(v: Any) -> Optional[str]:
    if v is None or (isinstance(v, str) and v):
        return None
    ok = isinstance(v, list) and all(isinstance(x, str) and x for x in v)
    return None if ok else "must be a list of strings"


def check_any(v: Any) -> Optional[str]:
    return None


# Conversions applied after a check passes.
def as_str_tuple(v: Any) -> Tuple[str, ...]:
    """``None`` -> ``()``, ``"x"`` -> ``("x",)``, a list -> a tuple."""
    return () if v is None else (v,) if isinstance(v, str) else tuple(v)


REQUIRED = dataclasses.MISSING  # option(REQUIRED, ...): the section must give the key


def option(default: Any, check: Callable[[Any], Optional[str]], doc: str,
           convert: Optional[Callable[[Any], Any]] = None) -> Any:
    """A dataclass field with its check, one-line meaning (docs/configs.md) and conversion.

    Args:
        default (Any): the value when the key is absent (``REQUIRED``: no default; a list or
            dict is copied per instance).
        check (Callable[[Any], Optional[str]]): None when a value is acceptable, else what it
            must be.
        doc (str): what the key does.
        convert (Optional[Callable[[Any], Any]]): applied to a given value after the check.

    Returns:
        Any: a ``dataclasses.field``.
    """
    meta = {"check": check, "doc": doc, "convert": convert}
    if default is REQUIRED:
        return field(metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def parse_section(cls: type, data: Any, name: str, errors: List[str], closest: Callable[..., str]) -> Any:
    """Build the dataclass ``cls`` from a config section, each key checked by its field.

    Args:
        cls (type): a dataclass whose fields are :func:`option`s.
        data (Any): the section (None: every default).
        name (str): the section's key, for messages (``data_loader``).
        errors (List[str]): problems are appended, one line each, naming the full key.
        closest (Callable[..., str]): ``" (did you mean 'x'?)"`` helper (``prefix=`` writes the
            suggestion as a full key).

    Returns:
        Any: the instance; defaults where a key is absent or bad, None when a required key
        is missing or ``data`` is not a mapping.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        errors.append(f"{name} must be a mapping, got {data!r}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        f = fields.get(k)
        if f is None:
            # The suggestion as the full key the user types (data_loader.num_workers).
            errors.append(f"unknown key '{name}.{k}'{closest(str(k), fields, prefix=f'{name}.')}; known: {', '.join(fields)}")
            continue
        check = f.metadata["check"]
        problem = check(v)
        if problem:
            choices = getattr(check, "choices", None)
            hint = closest(str(v), choices) if choices else ""
            errors.append(f"{name}.{k} {problem}, got {v!r}{hint}")
            continue
        convert = f.metadata.get("convert")
        kwargs[k] = convert(v) if convert else v
    required = [f.name for f in fields.values()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    absent = [k for k in required if k not in data]
    if absent:
        errors.append(f"{name}: missing required key '{absent[0]}'")
    if any(k not in kwargs for k in required):
        return None
    return cls(**kwargs)


@dataclass(frozen=True)
class DataLoaderOptions:
    """``data_loader``: how batches are loaded on each rank."""

    pin_memory: bool = option(False, check_bool, "CUDA only: page-locked host batches, faster copies")
    num_workers: int = option(0, check_int_ge0, "loader worker processes per rank (0: load in the training process)")
    split: str = option("distributed", check_choice(SPLIT_CHOICES), "distributed: interleaved over ranks; contiguous: rank r reads block r")
    prefetch_factor: Optional[int] = option(None, check_opt_int_gt0, "batches prefetched per worker (num_workers > 0)")
    persistent_workers: bool = option(False, check_bool, "keep workers alive between epochs (num_workers > 0)")


@dataclass(frozen=True)
class QuantizeOptions:
    """``quantize`` (QAT recipes): the post-training conversion after the last epoch."""

    enabled: bool = option(True, check_bool, "write <output_dir>/quantized/ after the last epoch")
    quantizer: Any = option(None, check_any, "quantizer component (default: the training quantizer)")
    model: Any = option(None, check_any, "model component to quantize (default: the base of `model`)")
    output_name: Optional[str] = option(None, check_opt_str, "file name (default: model-<mode>.pt)")


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Activation checkpointing, from torchtune's three keys.

    torchtune 0.6.1 (``full_finetune_distributed``, ``qat_distributed``): with
    ``enable_activation_checkpointing: True`` and no ``ac_mode``, every transformer layer is
    checkpointed; with ``enable_activation_checkpointing: False`` and ``ac_mode`` set,
    ``full`` checkpoints every layer and ``selective`` with ``ac_option: N`` every N-th
    layer (``0``: every layer). With both set torchtune applies neither (validation warns).
    The pack adds ``enable_activation_checkpointing: auto``: the fewest layers that fit the
    memory, measured at model build (``hlmtune/training/activation_memory.py``), within
    ``ac_auto_budget_gib`` when set.

    Attributes:
        every_n_layers (int): 0 = off; 1 = every layer; N = layers N-1, 2N-1, ... (0-based).
        auto (bool): chosen by memory at model build (``every_n_layers`` is then 0).
        budget_gib (Optional[float]): ``auto``'s per-rank budget; None = 0.9 x free memory.
    """

    every_n_layers: int = 0
    auto: bool = False
    budget_gib: Optional[float] = None

    def layers(self, num_layers: int) -> List[int]:
        """0-based indices of the layers to checkpoint."""
        if self.every_n_layers <= 0:
            return []
        return [i for i in range(num_layers) if (i + 1) % self.every_n_layers == 0]


@dataclass(frozen=True)
class PackOptions:
    """Everything the pack parses itself, with defaults; built by :func:`parse_pack_options`."""

    data_loader: DataLoaderOptions = field(default_factory=DataLoaderOptions)
    data_parallel: str = "auto"
    save_every_n_steps: Optional[int] = None
    keep_last_n_checkpoints: Optional[int] = None
    quantize: QuantizeOptions = field(default_factory=QuantizeOptions)
    activation_checkpointing: ActivationCheckpointing = field(default_factory=ActivationCheckpointing)
    log_peak_memory_stats: bool = True
    compile_mode: str = "default"


# The pack's own top-level keys (every recipe accepts them) and what each holds.
PACK_KEY_DOCS = {
    "data_loader": "mapping: " + ", ".join(f.name for f in dataclasses.fields(DataLoaderOptions)),
    "data_parallel": f"one of {DATA_PARALLEL_CHOICES}: auto = FSDP2 on CUDA, DDP on CPU",
    "save_every_n_steps": "resumable checkpoint every N optimizer steps (null: epoch ends only)",
    "keep_last_n_checkpoints": "older resumable checkpoints are deleted (null: keep all)",
    "ac_auto_budget_gib": "with enable_activation_checkpointing: auto, the GiB per rank activations, logits and "
                          "optimizer state may use (null: 0.9 x the device's free memory at model build)",
    "compile_mode": f"with compile: True, one of {COMPILE_MODES}: reduce-overhead = CUDA graphs "
                    "(CUDA, DDP or one device; fewer launches for small models)",
}


def section_keys(cls: type) -> frozenset:
    """The keys a section dataclass accepts."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def _parse_ac(data: Mapping[str, Any], accepted: frozenset, errors: List[str]) -> ActivationCheckpointing:
    raw = data.get("enable_activation_checkpointing", False)
    budget = data.get("ac_auto_budget_gib", None)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        errors.append(f"ac_auto_budget_gib must be a positive number (GiB) or null, got {budget!r}")
        budget = None
    if raw is not None and not isinstance(raw, bool) and raw != "auto":
        errors.append(f"enable_activation_checkpointing must be True, False or 'auto' (the fewest layers that fit "
                      f"the memory), got {raw!r}")
        return ActivationCheckpointing()
    enable = bool(raw)
    mode = data.get("ac_mode", None) if "ac_mode" in accepted else None
    option = data.get("ac_option", None) if "ac_option" in accepted else None
    if raw == "auto":
        if mode is not None:
            errors.append(f"enable_activation_checkpointing: auto and ac_mode ({mode!r}) are both set: choose one")
            return ActivationCheckpointing()
        return ActivationCheckpointing(0, auto=True, budget_gib=None if budget is None else float(budget))
    if mode is None:
        return ActivationCheckpointing(1 if enable else 0)
    if mode not in AC_MODES:
        errors.append(f"ac_mode must be one of {AC_MODES} or null, got {mode!r}")
        return ActivationCheckpointing()
    if enable:  # torchtune applies neither; config_warnings says so
        return ActivationCheckpointing()
    if mode == "none":
        return ActivationCheckpointing()
    if mode == "full":
        return ActivationCheckpointing(1)
    if isinstance(option, str) and option.isdigit():
        option = int(option)  # torchtune accepts '2' as 2
    if option == "op":
        errors.append("ac_option='op' (selective op checkpointing) is not implemented in torchtune 0.6.1: use an integer N (every N-th layer)")
        return ActivationCheckpointing()
    if not _is_int(option) or option < 0:
        errors.append(f"ac_option must be an integer >= 0 with ac_mode=selective (checkpoint every N-th layer, 0 = all), got {option!r}")
        return ActivationCheckpointing()
    return ActivationCheckpointing(option if option > 0 else 1)


def parse_pack_options(
    data: Mapping[str, Any], accepted: frozenset, errors: List[str], closest: Callable[..., str]
) -> PackOptions:
    """Parse and check the pack's keys of a resolved config.

    Args:
        data (Mapping[str, Any]): the resolved config (plain containers).
        accepted (frozenset): top-level keys the recipe accepts (keys it does not read, such
            as ``ac_mode`` on a LoRA recipe, keep their defaults).
        errors (List[str]): problems are appended here, one line each, naming the key.
        closest (Callable[..., str]): ``" (did you mean 'x'?)"`` helper (``prefix=`` writes the
            suggestion as a full key).

    Returns:
        PackOptions: parsed values; defaults where a key is absent or bad.
    """
    kw: dict = {}
    kw["data_loader"] = parse_section(DataLoaderOptions, data.get("data_loader"), "data_loader", errors, closest) or DataLoaderOptions()
    if "quantize" in accepted:
        kw["quantize"] = parse_section(QuantizeOptions, data.get("quantize"), "quantize", errors, closest) or QuantizeOptions()
    dp = data.get("data_parallel", "auto")
    if dp not in DATA_PARALLEL_CHOICES:
        errors.append(f"data_parallel must be one of {DATA_PARALLEL_CHOICES}, got {dp!r}{closest(str(dp), DATA_PARALLEL_CHOICES)}")
    else:
        kw["data_parallel"] = dp
    for key in ("save_every_n_steps", "keep_last_n_checkpoints"):
        v = data.get(key, None)
        problem = check_opt_int_gt0(v)
        if problem:
            errors.append(f"{key} {problem}, got {v!r}")
        else:
            kw[key] = v
    kw["activation_checkpointing"] = _parse_ac(data, accepted, errors)
    cm = data.get("compile_mode", "default")
    if cm not in COMPILE_MODES:
        errors.append(f"compile_mode must be one of {COMPILE_MODES}, got {cm!r}{closest(str(cm), COMPILE_MODES)}")
    else:
        kw["compile_mode"] = cm
    peak = data.get("log_peak_memory_stats", True)
    if peak is not None and not isinstance(peak, bool):
        errors.append(f"log_peak_memory_stats must be True or False, got {peak!r}")
    else:
        # Absent: on (the collector needs memory figures); explicit False turns them off.
        kw["log_peak_memory_stats"] = True if peak is None else peak
    return PackOptions(**kw)
