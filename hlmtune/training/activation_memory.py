"""Activation checkpointing chosen by memory: ``enable_activation_checkpointing: auto``.

torchtune's shipped single-device Llama3-8B LoRA, QLoRA and DPO configs checkpoint every
layer (``enable_activation_checkpointing: True``): safe on the smallest GPU they target, but
each checkpointed layer runs its forward twice, which costs a LoRA step (no weight gradients:
backward is about one forward) roughly a third more time. ``auto`` checkpoints only as many
layers as the memory needs:

1. **Measure** what one transformer layer keeps for backward: layer 0 runs forward on one
   row of 128 and of 256 random hidden states under ``saved_tensors_hooks``, and the distinct
   storages autograd saves (not parameters, buffers or the input) are summed. Two lengths
   separate the part linear in the sequence length from a quadratic one (attention kernels
   that materialise the (T, T) scores), so the cost extrapolates to ``batch x max_seq_len``.
2. **Budget**: the memory free on the device at model build (CUDA: ``mem_get_info``; CPU:
   ``MemAvailable`` shared by the ranks of the node) x 0.9, minus parameters not yet
   materialised (meta-built FSDP models), or ``ac_auto_budget_gib`` when set.
3. **Choose** the fewest checkpointed layers k with
   ``(L - k) * layer + k * input + [k > 0] * layer + head + optimizer <= budget``: a
   checkpointed layer keeps only its input (B, T, D), and backward recomputes one layer at a
   time. ``head`` (logits and their gradient, fp32) and ``optimizer`` (gradient + two AdamW
   moments per trainable parameter) are conservative upper bounds. The bottom k layers are
   checkpointed, so the last layer keeps the pack's labelled-positions fast path.

Under torchtune's own recipes, ``auto`` (a non-empty string) reads as True: every layer is
checkpointed there, as before.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Set, Tuple

import torch

log = logging.getLogger(__name__)

PROBE_LENGTHS = (128, 256)  # tokens of the two one-row probes (capped at max_seq_len)
BUDGET_FRACTION = 0.9  # of the free memory: allocator fragmentation, temporaries of backward
GIB = 1024 ** 3


@dataclass(frozen=True)
class LayerCost:
    """What one transformer layer keeps for backward, per row of the batch.

    Attributes:
        bytes_per_token (float): saved bytes growing linearly with the sequence length.
        bytes_per_token_sq (float): saved bytes growing with its square (materialised scores).
        input_bytes_per_token (float): the layer's input, all a checkpointed layer keeps.
    """

    bytes_per_token: float
    bytes_per_token_sq: float
    input_bytes_per_token: float

    def layer_bytes(self, rows: int, seq_len: int) -> float:
        """Saved bytes of one layer at (rows, seq_len), its input included."""
        t = float(seq_len)
        return rows * (self.bytes_per_token * t + self.bytes_per_token_sq * t * t + self.input_bytes_per_token * t)

    def input_bytes(self, rows: int, seq_len: int) -> float:
        """Bytes a checkpointed layer keeps: its input (rows, seq_len, D)."""
        return rows * self.input_bytes_per_token * float(seq_len)


def _storage_keys(t: torch.Tensor) -> List[Tuple[int, int]]:
    """(data pointer, bytes) of the storages behind ``t``.

    Wrapper subclasses without storage of their own (torchao's ``NF4Tensor``: QLoRA's frozen
    base weights) are followed through ``__tensor_flatten__`` to the plain tensors they hold.
    """
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [k for n in names for k in _storage_keys(getattr(t, n))]
    try:
        s = t.untyped_storage()
        return [(s.data_ptr(), s.nbytes())]
    except RuntimeError:  # another storage-less subclass: count its logical size once
        return [(id(t), t.numel() * t.element_size())]


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs.

    Views of one storage count once (the whole storage stays alive). Tensors sharing a
    storage with ``exclude`` (parameters, buffers, the input) are not counted. Whatever
    ``fn`` returns is dropped before this returns, so nothing stays alive.

    Args:
        fn (Callable[[], object]): runs a forward with autograd on.
        exclude (Iterable[torch.Tensor]): tensors whose storages are not activations.

    Returns:
        int: bytes.
    """
    skip: Set[Tuple[int, int]] = {k for t in exclude for k in _storage_keys(t)}
    seen: Set[Tuple[int, int]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        for key in _storage_keys(t):
            if key not in skip and key not in seen:
                seen.add(key)
                total += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return total


def probe_layer(layer: torch.nn.Module, *, embed_dim: int, dtype: torch.dtype, device: torch.device,
                max_seq_len: int) -> LayerCost:
    """Measure one layer's saved activations at two short lengths (see the module docstring).

    The layer runs in its current train/eval mode; the random-number state is restored after
    (dropout draws must not shift the training run).

    Args:
        layer (torch.nn.Module): a transformer layer, ``layer(x)`` with x (B, T, D).
        embed_dim (int): D.
        dtype (torch.dtype): activation dtype.
        device (torch.device): where the layer lives.
        max_seq_len (int): longest sequence of the run (caps the probe lengths).

    Returns:
        LayerCost: per-row cost, linear and quadratic parts.
    """
    # Attention in query blocks (fastpath.use_blocked_causal_attention, CPU) saves more than one
    # causal call (per block, SDPA copies grouped K/V heads for its keys): both probe lengths
    # then take the blocked path the run takes, so the line is fitted to one code path.
    block = max((getattr(m, "_causal_block", 0) for m in layer.modules()), default=0)
    probes = (2 * block, 4 * block) if block and max_seq_len >= 2 * block else PROBE_LENGTHS
    lengths = sorted({min(n, max_seq_len) for n in probes})
    exclude = list(layer.parameters()) + list(layer.buffers())
    measured = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
        for t in lengths:
            x = torch.randn(1, t, embed_dim, dtype=dtype, device=device, requires_grad=True)  # (1, T, D)
            measured.append((t, saved_bytes(lambda: layer(x), exclude=exclude + [x])))
    elem = torch.empty((), dtype=dtype).element_size()
    if len(measured) == 1:  # max_seq_len <= the shorter probe: no extrapolation needed
        (t, m), = measured
        return LayerCost(m / t, 0.0, embed_dim * elem)
    (t1, m1), (t2, m2) = measured
    # m = b * t + c * t^2  =>  m / t = b + c * t: a line through the two per-token costs.
    c = max(0.0, (m2 / t2 - m1 / t1) / (t2 - t1))
    b = max(0.0, m2 / t2 - c * t2)
    return LayerCost(b, c, embed_dim * elem)


def checkpointed_layer_count(num_layers: int, layer_bytes: float, input_bytes: float, fixed_bytes: float,
                             budget_bytes: float) -> Optional[int]:
    """The fewest layers to checkpoint so the estimate fits the budget.

    Args:
        num_layers (int): L.
        layer_bytes (float): one un-checkpointed layer's saved bytes.
        input_bytes (float): one checkpointed layer's saved bytes (its input).
        fixed_bytes (float): everything else that grows in training (logits, optimizer).
        budget_bytes (float): what may be used.

    Returns:
        Optional[int]: k in [0, L]; None when even k = L does not fit.
    """
    for k in range(num_layers + 1):
        need = (num_layers - k) * layer_bytes + k * input_bytes + (layer_bytes if k else 0.0) + fixed_bytes
        if need <= budget_bytes:
            return k
    return None


def mem_available_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_memory_bytes(device: torch.device) -> Tuple[Optional[int], str]:
    """Memory this rank may still use on its device, and where the figure came from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, "cuda mem_get_info free"
    avail = mem_available_bytes()
    if avail is None:
        return None, "MemAvailable unreadable"
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return avail // ranks, f"MemAvailable / {ranks} local rank(s)"


def _materialized_copy(layer: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A real copy of a meta-built layer (values uninitialised: only sizes are measured)."""
    twin = copy.deepcopy(layer).to_empty(device=device)
    with torch.no_grad():
        for p in twin.parameters():
            if type(p.data) is torch.Tensor:
                if p.is_floating_point():
                    p.normal_(0.0, 0.02)
            elif hasattr(p, "__tensor_flatten__"):
                # torchao's NF4Tensor.to_empty leaves scaler_mean and the nf4 table on meta:
                # allocate what it missed (on the parameter itself: .data is a fresh alias).
                for name in p.__tensor_flatten__()[0]:
                    inner = getattr(p, name)
                    if inner.is_meta:
                        setattr(p, name, torch.zeros(inner.shape, dtype=inner.dtype, device=device))
    for m in twin.modules():
        if hasattr(m, "rope_init"):
            with device:
                m.rope_init()
    return twin


def choose_checkpointed_layers(model: torch.nn.Module, *, rows: int, max_seq_len: int, dtype: torch.dtype,
                               device: torch.device, budget_gib: Optional[float], shards: int = 1,
                               log_fn: Callable[[str], None] = log.info) -> list:
    """Layers to checkpoint under ``enable_activation_checkpointing: auto``.

    Args:
        model (torch.nn.Module): the ``TransformerDecoder`` (``layers``, ``tok_embeddings``,
            ``output``), trainable parameters already chosen; on its device or on meta.
        rows (int): rows of one forward (batch size; DPO: chosen + rejected).
        max_seq_len (int): longest row.
        dtype (torch.dtype): activation dtype.
        device (torch.device): the rank's device.
        budget_gib (Optional[float]): per-rank budget; None = 0.9 x free memory.
        shards (int): ranks the parameters and optimizer state are sharded over (FSDP), else 1.
        log_fn (Callable[[str], None]): where the decision is reported.

    Returns:
        list: 0-based layer indices (the bottom k).
    """
    layers = model.layers
    num_layers = len(layers)
    first = layers[0]
    on_meta = any(p.is_meta for p in model.parameters())
    try:
        probe = _materialized_copy(first, device) if on_meta else first
        embed_dim = model.tok_embeddings.embedding_dim
        cost = probe_layer(probe, embed_dim=embed_dim, dtype=dtype, device=device, max_seq_len=max_seq_len)
        del probe
    except Exception as e:  # noqa: BLE001 - any layer we cannot run: the safe choice
        log.warning("enable_activation_checkpointing=auto: could not measure layer 0 (%s: %s): checkpointing every layer",
                    type(e).__name__, e)
        return list(range(num_layers))
    layer_b = cost.layer_bytes(rows, max_seq_len)
    input_b = cost.input_bytes(rows, max_seq_len)
    from hlmtune.training.fastpath import output_vocab_size

    vocab = output_vocab_size(model.output) or 0  # nn.Linear, LoRA or tied to the embeddings (TiedLinear)
    head_b = rows * max_seq_len * float(vocab) * 4 * 2  # fp32 logits and their gradient
    elem = torch.empty((), dtype=dtype).element_size()
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optim_b = 3.0 * n_train * elem / shards  # gradient + AdamW's two moments
    if budget_gib is not None:
        budget, source = budget_gib * GIB, "ac_auto_budget_gib"
    else:
        free, source = free_memory_bytes(device)
        if free is None:
            log.warning("enable_activation_checkpointing=auto: free memory unknown (%s): checkpointing every layer", source)
            return list(range(num_layers))
        unbuilt = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_meta) / shards if on_meta else 0.0
        budget = BUDGET_FRACTION * free - unbuilt
        source = f"{BUDGET_FRACTION:g} x {source} ({free / GIB:.2f} GiB)" + (f" - unbuilt parameters {unbuilt / GIB:.2f} GiB" if unbuilt else "")
    k = checkpointed_layer_count(num_layers, layer_b, input_b, head_b + optim_b, budget)
    need_all = num_layers * layer_b + head_b + optim_b
    msg = (f"enable_activation_checkpointing=auto: one layer keeps {layer_b / GIB:.3f} GiB of activations at "
           f"{rows} x {max_seq_len} tokens (measured on layer 0), all {num_layers} layers + logits + optimizer "
           f"{need_all / GIB:.2f} GiB; budget {budget / GIB:.2f} GiB ({source})")
    if k is None:
        log.warning("%s: does not fit even with every layer checkpointed: checkpointing all %d; lower batch_size or "
                    "tokenizer.max_seq_len if it runs out of memory", msg, num_layers)
        return list(range(num_layers))
    log_fn(f"{msg}: checkpointing {k} of {num_layers} layers" + (f" (0..{k - 1})" if k else ""))
    return list(range(k))
